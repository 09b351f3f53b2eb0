"""Trainer rank 0's half of ``broadcast``: the rendezvous store, the group and the bucketed send (imports torch).

``BroadcastTransport`` (``rollflow.weights.broadcast``) reaches this module through its session on each call.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from rollflow.errors import WeightTransferError
from rollflow.weights.base import is_timeout
from rollflow.weights.broadcast import BroadcastTransport, advertised_address
from rollflow.weights.groups import Group, create_group, default_backend, device_for, timeout_error
from rollflow.weights.packing import TensorSpec, pack
from rollflow.weights.ranks import TRAINER_RANK

log = structlog.get_logger(__name__)


class BroadcastSession:
    """Rank 0's side of one connection: the store (bound on a free port at once, so no other process can take
    the port between picking and binding) and, once joined, the group. A transport without a backend gets
    this process's default (NCCL with a GPU, else gloo), reported to the control half by ``open``."""

    def __init__(self, transport: BroadcastTransport):
        self.transport = transport
        self.backend = transport.backend or default_backend()
        self.address = advertised_address(transport.master_address)
        # Port 0: the OS picks a free port and the store holds it from now on.
        self._tcp_store: dist.TCPStore | None = dist.TCPStore(
            transport.master_address,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=transport.timeout_s),
        )
        self.port = self._tcp_store.port
        self._store = dist.PrefixStore(transport.transfer_id, self._tcp_store)
        self._group: Group | None = None
        self.specs: list[TensorSpec] = []
        self.failed: str | None = None

    def join(self) -> None:
        if self._group is not None:
            return
        t = self.transport
        try:
            group = create_group(self.backend, self._store, TRAINER_RANK, t.world_size, t.timeout_s)
        except Exception as exc:
            self.failed = f"its group never formed ({type(exc).__name__})"
            if is_timeout(exc):
                raise timeout_error("forming the weight-transfer group", t.timeout_s, exc) from exc
            raise
        self._group = Group(group)
        log.debug("weight transport joined", world_size=t.world_size, backend=self.backend)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.failed is not None:
            raise WeightTransferError(f"this weight transport is unusable: {self.failed}; reconnect")
        if self._group is None:
            raise WeightTransferError("the weight transport must join its group before a push")
        try:
            self._group.run(lambda group: self._broadcast(group, weights))
        except Exception as exc:
            self.failed = f"a push failed mid-transfer ({type(exc).__name__})"
            # Leave the group now: the servers blocked on this broadcast fail at once instead of at their
            # timeout, and the control half hears from them within its grace period.
            if self._group is not None:
                self._group.close()
            if is_timeout(exc):
                raise timeout_error("broadcasting weights", self.transport.timeout_s, exc) from exc
            raise

    def _broadcast(self, group: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Buckets filled in iteration order until they hold ``bucket_size_bytes`` (``plan_buckets``'s rule,
        which the receivers follow from the metadata); each checked against the metadata sent at open."""
        device = device_for(self.backend)
        pending = None
        bucket: list[torch.Tensor] = []
        size = index = 0

        def flush() -> None:
            nonlocal pending
            # Pack the next bucket while the previous one is on the wire (two buffers in flight).
            buffer = pack(bucket, device)
            work = group.broadcast(buffer, TRAINER_RANK)
            if pending is not None:
                pending[0].wait()
            pending = (work, buffer)  # the buffer must outlive its broadcast

        for name, tensor in weights:
            spec = self.specs[index] if index < len(self.specs) else None
            if (
                spec is None
                or spec.name != name
                or spec.shape != tuple(tensor.shape)
                or spec.dtype != tensor.dtype
            ):
                raise WeightTransferError(
                    f"weight {index} is {name!r} {tuple(tensor.shape)} {tensor.dtype}, but the transport was "
                    f"opened for {spec}: the model changed since; reconnect"
                )
            index += 1
            bucket.append(tensor)
            size += spec.nbytes
            if size >= self.transport.bucket_size_bytes:
                flush()
                bucket, size = [], 0
        if index != len(self.specs):
            raise WeightTransferError(
                f"the trainer yielded {index} weights but the transport was opened for {len(self.specs)}"
            )
        if bucket:
            flush()
        if pending is not None:
            pending[0].wait()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._tcp_store = None
        self.failed = self.failed or "it was closed"
