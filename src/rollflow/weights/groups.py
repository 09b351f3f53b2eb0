"""torch.distributed pieces both ends of a broadcast share: the default backend, standalone process groups and
their safe shutdown. Imports torch: used by ``weights.trainer.broadcast`` and ``weights.server.broadcast`` only.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from rollflow.errors import InvalidTransferInfoError, WeightTransferError, WeightTransferTimeoutError

log = structlog.get_logger(__name__)


def default_backend() -> str:
    """NCCL when this process sees a GPU, else gloo: what an ``init_info`` without ``backend`` means."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str) -> torch.device:
    """Where a group of ``backend`` keeps its buffers: this process's current GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def create_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group over ``store`` without touching torch.distributed's default group. Blocks until every
    rank joined, or raises after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # NCCL connects lazily; a first tiny collective makes every rank wait for the others here.
        group.barrier().wait()
        return group
    raise InvalidTransferInfoError(
        f"init_info.backend must be 'gloo' or 'nccl' for a broadcast, got {backend!r}"
    )


class Group:
    """A process group whose ``shutdown`` waits for the collective in flight: a timed-out collective runs on in
    an abandoned thread until the group's own timeout, and tearing the group down under it can crash."""

    def __init__(self, group: Any):
        self._group = group
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False

    def run(self, collective: Callable[[Any], None]) -> None:
        """``collective(group)`` on this thread, unless the group is closed."""
        with self._lock:
            if self._closed:
                raise WeightTransferError("the weight-transfer group is closed")
            self._busy += 1
        try:
            collective(self._group)
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closed and self._busy == 0
            if last:
                self._shutdown()

    def close(self) -> None:
        """Shut the group down now, or when its collective in flight ends. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._busy == 0
        if idle:
            self._shutdown()

    def _shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception as exc:  # teardown of a broken group must not mask the original error
                log.debug("weight group shutdown failed", error=str(exc))


def timeout_error(what: str, timeout_s: float, exc: BaseException) -> WeightTransferTimeoutError:
    """The error of a group step ``what`` that outlived the group's ``timeout_s``."""
    return WeightTransferTimeoutError(
        f"{what} did not complete within {timeout_s:g} s (a peer is missing or hung): {exc}"
    )
