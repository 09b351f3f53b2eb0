"""The engine server's side of weight transfer: one receiver per ``/init_weight_transfer_engine``.

The server uses exactly this::

    receiver = create_receiver(init_info, worker_rank)   # blocking (may join a process group): run in a thread
    tensors = receiver.receive(update_info)               # blocking; [(hf_name, tensor), ...]
    await engine.load_weights(tensors, policy_version=update_info.get("policy_version", ...))
    receiver.close()

``init_info["backend"]`` selects the receiver:
- ``"gloo"`` / ``"nccl"``: join the trainer's broadcast group as rank ``init_info["rank_offset"] + worker_rank``
  (``worker_rank`` is the worker's index inside its server, 0 for a single-worker torch server);
  ``update_info`` = ``{names, dtype_names, shapes, policy_version}``, bytes arrive through the collective.
- ``"checkpoint"``: ``update_info`` = ``{path | url, policy_version}``; a safetensors file is read from a shared
  directory, or fetched from the trainer's HTTP endpoint.
- ``"ipc"``: colocated GPU; ``update_info`` carries CUDA IPC handles of packed buffers.

An ``init_info`` in vLLM 0.33's shape (no ``backend``) is accepted too: a rendezvous (``master_address``) means a
broadcast over NCCL with a GPU, else gloo; ``{"packed": ...}`` alone means ``"ipc"``. Missing ``group_name`` and
``timeout_s`` take their defaults.

Every receiver gives up after ``init_info["timeout_s"]`` (default 300 s) with ``WeightTransferTimeoutError``.
A new ``/init_weight_transfer_engine`` should ``close()`` the previous receiver first (the trainer reconnects
after a failed transfer).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from rollflow.errors import InvalidTransferInfoError
from rollflow.weights.base import RECEIVER_BACKENDS


class WeightReceiver(Protocol):
    """Turns one ``update_info`` into named tensors (Hugging Face state-dict names)."""

    def receive(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]: ...

    def close(self) -> None: ...


def create_receiver(init_info: dict[str, Any], worker_rank: int = 0) -> WeightReceiver:
    """Build the receiver ``init_info["backend"]`` names. Blocks until a process-group backend has formed its
    group (every worker and the trainer joined), so call it from a thread.

    Raises:
        InvalidTransferInfoError: ``init_info`` is not a dict, names an unknown backend, or has a bad field
            (a ValueError: answer it with HTTP 400).
        WeightTransferTimeoutError: the group did not form within ``init_info["timeout_s"]``.
        WeightTransferError: the trainer's rendezvous could not be reached, or another failure.
    """
    if not isinstance(init_info, dict):
        raise InvalidTransferInfoError(f"init_info must be a JSON object, got {type(init_info).__name__}")
    if not isinstance(worker_rank, int) or worker_rank < 0:
        raise InvalidTransferInfoError(f"worker_rank must be a non-negative int, got {worker_rank!r}")
    backend = init_info.get("backend")
    if backend is None and "master_address" in init_info:
        from rollflow.weights.broadcast import default_backend

        backend = default_backend()
    elif backend is None and set(init_info) == {"packed"}:
        backend = "ipc"
    if backend in ("gloo", "nccl"):
        from rollflow.weights.broadcast import BroadcastReceiver

        return BroadcastReceiver(init_info, worker_rank)
    if backend == "checkpoint":
        from rollflow.weights.checkpoint import CheckpointReceiver

        return CheckpointReceiver(init_info)
    if backend == "ipc":
        from rollflow.weights.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(init_info)
    raise InvalidTransferInfoError(
        f"init_info.backend is {backend!r}; expected one of {', '.join(map(repr, RECEIVER_BACKENDS))}"
    )
