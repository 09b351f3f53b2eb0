"""Tensor metadata and bucket packing, shared by the senders and receivers.

The packed format is vLLM's: each tensor is made contiguous, flattened and viewed as ``uint8``; tensors are
concatenated in iteration order into a bucket until its size reaches ``bucket_size_bytes`` (a tensor larger
than that gets a bucket of its own). Both sides derive the same buckets from ``(names, dtype_names, shapes)``,
so only the metadata travels in ``update_info`` and only raw bytes travel in the collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollflow.errors import InvalidTransferInfoError

if TYPE_CHECKING:
    from rollflow.weights.payloads import TensorsUpdate


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: what the receiver needs to rebuild it from bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's ``dtype_names`` form: the torch attribute name (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    """The torch dtype called ``name``.

    Raises:
        InvalidTransferInfoError: ``name`` is not a torch dtype name.
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidTransferInfoError(
            f"update_info.dtype_names has {name!r}, which is not a torch dtype name"
        )
    return dtype


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in named_tensors]


def specs_to_info(specs: Sequence[TensorSpec]) -> dict[str, list]:
    """The ``names`` / ``dtype_names`` / ``shapes`` fields of an ``update_info``."""
    return {
        "names": [spec.name for spec in specs],
        "dtype_names": [dtype_name(spec.dtype) for spec in specs],
        "shapes": [list(spec.shape) for spec in specs],
    }


def specs_from_info(update_info: Mapping[str, Any] | TensorsUpdate) -> list[TensorSpec]:
    """Parse and check the metadata lists of an ``update_info`` (its JSON, or its decoded Struct).

    Raises:
        InvalidTransferInfoError: a list is missing, of the wrong type, or of another length than ``names``.
    """
    lists = {}
    for key in ("names", "dtype_names", "shapes"):
        value = update_info.get(key) if isinstance(update_info, Mapping) else getattr(update_info, key)
        if not isinstance(value, list):
            raise InvalidTransferInfoError(f"update_info.{key} must be a list, got {type(value).__name__}")
        lists[key] = value
    names, dtypes, shapes = lists["names"], lists["dtype_names"], lists["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidTransferInfoError(
            "update_info.names, dtype_names and shapes must have equal lengths "
            f"({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str):
            raise InvalidTransferInfoError(f"update_info.names has {name!r}, which is not a string")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise InvalidTransferInfoError(
                f"update_info.shapes has {shape!r} for {name!r}: not a list of sizes"
            )
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(shape)))
    return specs


def plan_buckets(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket: filled in order until a bucket holds ``bucket_size_bytes`` or more."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, spec in enumerate(specs):
        current.append(index)
        size += spec.nbytes
        if size >= bucket_size_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def pack(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One ``uint8`` buffer holding the bytes of ``tensors`` back to back (on ``device``, default their own)."""
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Split a packed ``buffer`` back into named tensors. They are views of ``buffer`` where the byte offset
    is aligned for their dtype, copies where it is not (a 2-byte tensor of odd length before a 4-byte one).

    Raises:
        WeightTransferError: the buffer's size is not the specs' total.
    """
    sizes = [spec.nbytes for spec in specs]
    if buffer.numel() != sum(sizes):
        raise InvalidTransferInfoError(
            f"packed buffer has {buffer.numel()} bytes, the metadata says {sum(sizes)}"
        )
    out = []
    for spec, part in zip(specs, buffer.split(sizes), strict=True):
        if part.storage_offset() % spec.dtype.itemsize:
            part = part.clone()
        out.append((spec.name, part.view(spec.dtype).view(spec.shape)))
    return out


def gpu_uuid(device: torch.device) -> str:
    """The UUID of ``device``'s GPU: how a CUDA IPC handle names the GPU its buffer lives on."""
    return str(torch.cuda.get_device_properties(device).uuid)
