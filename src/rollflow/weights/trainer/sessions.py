"""What every transport half shares on the trainer side: per-process sessions and the weight iterator.

A transport spec is shipped by value to each trainer rank for every call, so what must outlive one call (a
process group, a TCP store, an HTTP server, the buffers of a CUDA IPC bucket) is kept here, per process,
keyed by ``(transfer_id, rank)``. A new connection's ``open`` releases the sessions of the connections it
replaces; a trainer process or worker releases the rest when it exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog
import torch

from rollflow.errors import WeightTransferError

log = structlog.get_logger(__name__)

_lock = threading.Lock()
_sessions: dict[tuple[str, int], Any] = {}


def open_session(transfer_id: str, rank: int, create: Callable[[], Any]) -> Any:
    """The session of ``(transfer_id, rank)``, created by ``create()`` unless it exists."""
    with _lock:
        session = _sessions.get((transfer_id, rank))
    if session is None:
        session = create()
        with _lock:
            _sessions[(transfer_id, rank)] = session
    return session


def get_session(transfer_id: str, rank: int) -> Any:
    """The session ``open`` created in this process.

    Raises:
        WeightTransferError: there is none (the transport was never opened here, or was released).
    """
    with _lock:
        session = _sessions.get((transfer_id, rank))
    if session is None:
        raise WeightTransferError(
            f"no weight-transfer session {transfer_id} in this process: the transport was not opened here "
            "(or was released); the control half must open it first"
        )
    return session


def release_sessions(transfer_ids: Iterable[str]) -> None:
    """Close and forget every session of ``transfer_ids`` in this process (unknown ids are ignored)."""
    wanted = set(transfer_ids)
    with _lock:
        keys = [key for key in _sessions if key[0] in wanted]
        sessions = [_sessions.pop(key) for key in keys]
    for session in sessions:
        try:
            session.close()
        except Exception as exc:  # releasing a broken session must not fail the next connection
            log.debug("releasing a weight-transfer session failed", error=str(exc))


def transfer_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``weight_sync.dtype`` (None for ``auto``: as the trainer holds them)."""
    return None if name == "auto" else getattr(torch, name)


def full_weights(
    named_weights: Iterable[tuple[str, Any]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` with every DTensor gathered (``full_tensor()``, a collective every rank of its mesh
    must join, in the same order) and floating tensors cast to ``dtype``; detached. One tensor at a time, so
    a sharded model is never whole in memory at once."""
    for name, value in named_weights:
        tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2): each rank holds a shard
            tensor = tensor.full_tensor()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def weight_specs(named_weights: Iterable[tuple[str, Any]], dtype: torch.dtype | None) -> dict[str, list]:
    """The ``names`` / ``dtype_names`` / ``shapes`` of what ``full_weights`` will yield, without gathering
    (a DTensor's ``shape`` is already the full one)."""
    from rollflow.weights.packing import dtype_name

    names, dtype_names, shapes = [], [], []
    for name, value in named_weights:
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        wire_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        names.append(name)
        dtype_names.append(dtype_name(wire_dtype))
        shapes.append(list(tensor.shape))
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes}
