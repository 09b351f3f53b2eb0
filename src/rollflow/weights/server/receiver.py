"""The engine server's side of weight transfer: one receiver per ``/init_weight_transfer_engine``.

The server uses exactly this::

    receiver = create_receiver(init_info, worker_rank)   # blocking (may join a process group): run in a thread
    tensors = receiver.receive(update_info)               # blocking; [(hf_name, tensor), ...]
    await engine.load_weights(tensors, policy_version=update_info.get("policy_version", ...))
    receiver.close()

``init_info`` is decoded into its Struct (``rollflow.weights.payloads``), whose ``backend`` selects the receiver:
- ``"gloo"`` / ``"nccl"``: join the trainer's broadcast group as rank ``init_info["rank_offset"] + worker_rank``
  (``worker_rank`` is the worker's index inside its server, 0 for a single-worker torch server);
  ``update_info`` = ``{names, dtype_names, shapes, policy_version}``, bytes arrive through the collective.
- ``"checkpoint"``: ``update_info`` = ``{path | url, policy_version}``; a safetensors file is read from a shared
  directory, or fetched from the trainer's HTTP endpoint.
- ``"ipc"``: colocated GPU; ``update_info`` carries CUDA IPC handles of packed buffers.

An ``init_info`` in vLLM 0.33's shape (no ``backend``) is accepted too: a rendezvous (``master_address``) means a
broadcast over NCCL with a GPU, else gloo; ``{"packed": ...}`` alone means ``"ipc"``. Missing ``group_name`` and
``timeout_s`` take their defaults.

Every receiver gives up after ``init_info["timeout_s"]`` (default 300 s) with ``WeightTransferTimeoutError``,
``create_receiver`` included: it is bounded end to end, also where a library call has no deadline of its own
(torch's ``TCPStore`` client waits for ever on a peer that accepts the connection and never answers). Such a
call is left to finish in its thread, and a receiver it returns late is closed. A new
``/init_weight_transfer_engine`` should ``close()`` the previous receiver first (the trainer reconnects after a
failed transfer).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import structlog

from rollflow.errors import InvalidTransferInfoError, WeightTransferTimeoutError
from rollflow.weights.payloads import (
    DEFAULT_TIMEOUT_S,
    AnyInitInfo,
    BroadcastInit,
    CheckpointInit,
    IpcInit,
    decode_init_info,
)
from rollflow.weights.server.state import Receiver as WeightReceiver

log = structlog.get_logger(__name__)

#: ``init_info["timeout_s"]`` when it has none (vLLM's payloads have none).
DEFAULT_INIT_TIMEOUT_S = DEFAULT_TIMEOUT_S


def init_timeout_s(init_info: Any) -> float:
    """``init_info["timeout_s"]``: the seconds a receiver's initialization and each of its updates may take
    (``DEFAULT_INIT_TIMEOUT_S`` when absent).

    Raises:
        InvalidTransferInfoError: ``init_info`` is not a dict, or ``timeout_s`` is not a positive finite number.
    """
    if not isinstance(init_info, dict):
        raise InvalidTransferInfoError(f"init_info must be a JSON object, got {type(init_info).__name__}")
    value = init_info.get("timeout_s", DEFAULT_INIT_TIMEOUT_S)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value > 0 and math.isfinite(value))
    ):
        raise InvalidTransferInfoError(
            f"init_info.timeout_s must be a positive number of seconds, got {value!r}; send e.g. "
            f"{DEFAULT_INIT_TIMEOUT_S:g} (weight_sync.timeout_s), or leave it out for that default"
        )
    return float(value)


def create_receiver(init_info: dict[str, Any], worker_rank: int = 0) -> WeightReceiver:
    """Build the receiver ``init_info["backend"]`` names. Blocks until a process-group backend has formed its
    group (every worker and the trainer joined), at most ``init_info["timeout_s"]``, so call it from a thread.

    Raises:
        InvalidTransferInfoError: ``init_info`` is not a dict, names an unknown backend, or has a bad field
            (a ValueError: answer it with HTTP 400).
        WeightTransferTimeoutError: the receiver was not ready within ``init_info["timeout_s"]`` (the group did
            not form, or the trainer's rendezvous accepted the connection and never answered).
        WeightTransferError: the trainer's rendezvous could not be reached, or another failure.
    """
    timeout_s = init_timeout_s(init_info)
    if not isinstance(worker_rank, int) or worker_rank < 0:
        raise InvalidTransferInfoError(f"worker_rank must be a non-negative int, got {worker_rank!r}")
    payload = decode_init_info(init_info, _default_backend)
    where = (
        f" (rendezvous {payload.master_address}:{payload.master_port})"
        if isinstance(payload, BroadcastInit)
        else ""
    )
    return within_timeout(
        lambda: _build(payload, worker_rank),
        timeout_s,
        f"initializing the weight receiver{where}",
    )


def within_timeout(build: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``build()`` run in a daemon thread, waited for at most ``timeout_s``. Past it, the thread is left to
    finish on its own (a blocking library call cannot be interrupted), whatever it returns then is closed, and
    ``WeightTransferTimeoutError`` names ``what`` and ``init_info.timeout_s``."""
    lock = threading.Lock()
    done = threading.Event()
    outcome: dict[str, Any] = {}
    abandoned = False

    def run() -> None:
        try:
            result, error = build(), None
        except BaseException as exc:  # handed to the caller
            result, error = None, exc
        with lock:
            late = abandoned
            outcome.update(result=result, error=error)
        done.set()
        if late and error is None:
            log.warning("a weight receiver initialized after its timeout; closing it", what=what)
            close = getattr(result, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    log.exception("closing a late weight receiver failed")

    threading.Thread(target=run, name="rollflow-weight-receiver-init", daemon=True).start()
    done.wait(timeout_s)
    with lock:
        if not outcome:
            abandoned = True
            raise WeightTransferTimeoutError(
                f"{what} did not complete within init_info.timeout_s = {timeout_s:g} s (the trainer side is "
                "missing, hung, or not a weight-transfer rendezvous); check the trainer, or raise "
                "weight_sync.timeout_s"
            )
    if outcome["error"] is not None:
        raise outcome["error"]
    return outcome["result"]


def _default_backend() -> str:
    from rollflow.weights.groups import default_backend

    return default_backend()


def _build(payload: AnyInitInfo, worker_rank: int) -> WeightReceiver:
    """The receiver of ``payload``'s backend (blocking: a broadcast joins its group)."""
    if isinstance(payload, BroadcastInit):
        from rollflow.weights.server.broadcast import BroadcastReceiver

        return BroadcastReceiver(payload, worker_rank)
    if isinstance(payload, CheckpointInit):
        from rollflow.weights.server.checkpoint import CheckpointReceiver

        return CheckpointReceiver(payload)
    if isinstance(payload, IpcInit):
        from rollflow.weights.server.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(payload)
    raise AssertionError(f"no receiver for {type(payload).__name__}")  # decode_init_info's union is covered
