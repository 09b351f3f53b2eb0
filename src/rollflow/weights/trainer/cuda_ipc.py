"""Trainer ranks' half of ``cuda_ipc``: pack each bucket and export its CUDA IPC handle (imports torch)."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rollflow.weights.packing import TensorSpec, gpu_uuid, pack, specs_of, specs_to_info
from rollflow.weights.payloads import IpcUpdate


def ipc_update_info(
    specs: list[TensorSpec], handles: dict[str, Any], policy_version: int | None
) -> dict[str, Any]:
    """The ``update_info`` of one packed bucket: vLLM's packed IPC fields, plus ``policy_version`` unless None
    (vLLM rejects it)."""
    update = IpcUpdate(
        **specs_to_info(specs),
        tensor_sizes=[spec.nbytes for spec in specs],
        ipc_handles_pickled=base64.b64encode(pickle.dumps(handles)).decode("ascii"),
        policy_version=policy_version,
    )
    return update.encode_for("torch" if policy_version is not None else "vllm")


def buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive weights, cut as ``plan_buckets`` cuts them."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_size_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class IpcSession:
    """One rank's pass over the buckets, and rank 0's buffer of the bucket the servers are reading."""

    def __init__(self) -> None:
        self._buckets: Iterator[list[tuple[str, torch.Tensor]]] = iter(())
        self._version: int | None = None
        self._buffer: torch.Tensor | None = None

    def start(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], policy_version: int | None) -> None:
        self._buckets, self._version, self._buffer = buckets, policy_version, None

    def next(self, rank: int) -> dict[str, Any] | None:
        from torch.multiprocessing.reductions import reduce_tensor

        self._buffer = None  # the servers copied the previous bucket out
        bucket = next(self._buckets, None)
        if bucket is None:
            if rank == 0:
                torch.cuda.ipc_collect()
            return None
        if rank != 0:
            return None
        device = torch.device("cuda", torch.cuda.current_device())
        self._buffer = pack([tensor for _, tensor in bucket], device)
        torch.cuda.synchronize(device)  # the receiver reads on another process's stream
        handles = {gpu_uuid(device): reduce_tensor(self._buffer)}
        return ipc_update_info(specs_of(bucket), handles, self._version)

    def close(self) -> None:
        self._buffer = None
        self._buckets = iter(())
