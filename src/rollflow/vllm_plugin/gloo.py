"""The gloo transport of rollflow's vLLM engine: join trainer rank 0's broadcast group, receive packed buckets.

The trainer side is rollflow's ``broadcast`` strategy with ``backend = "gloo"`` (``rollflow.weights.broadcast``
and ``rollflow.weights.trainer.broadcast``): rank 0 binds a ``TCPStore``, every inference worker joins a
``ProcessGroupGloo`` over it (under the connection's ``group_name`` prefix) as rank ``rank_offset +
worker_rank``, and each update broadcasts the weights packed in buckets. The packing is the one of
``rollflow.weights.packing``: tensors flattened to bytes, concatenated in order until a bucket holds
``packed_buffer_size_bytes`` or more; both sides derive the same buckets from the update's metadata, so only
raw bytes travel in the collective.

This module runs inside vLLM's environment and imports only the standard library and torch (not rollflow's
packing, which needs rollflow's dependencies): ``plan_buckets`` repeats that module's rule, and
``tests/test_vllm_broadcast_payloads.py`` checks that the two agree.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

#: The trainer's rank in every weight-transfer group.
TRAINER_RANK = 0


def plan_buckets(nbytes: Sequence[int], bucket_size_bytes: int) -> list[list[int]]:
    """Indices per bucket, filled in order until a bucket holds ``bucket_size_bytes`` or more (the rule of
    ``rollflow.weights.packing.plan_buckets``)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, count in enumerate(nbytes):
        current.append(index)
        size += count
        if size >= bucket_size_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``).

    Raises:
        ValueError: not a torch dtype name.
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update_info.dtype_names has {name!r}, which is not a torch dtype name")
    return dtype


class GlooReceiver:
    """One inference worker's membership of the trainer's gloo group (blocks in ``__init__`` until every rank
    joined, or ``timeout_s``).

    Raises (``__init__``):
        ValueError: the rank is outside the group, or another worker took it already.
        RuntimeError: the trainer's store cannot be reached, or the group did not form in time.
    """

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        group_name: str,
        bucket_size_bytes: int,
        timeout_s: float,
    ):
        if not 0 < rank < world_size:
            raise ValueError(
                f"this worker's rank {rank} is outside 1..{world_size - 1}: init_info.world_size counts the "
                "trainer plus every inference worker; it was made for fewer workers than there are"
            )
        if bucket_size_bytes <= 0:
            raise ValueError(f"init_info.packed_buffer_size_bytes must be positive, got {bucket_size_bytes}")
        self.rank = rank
        self.bucket_size_bytes = bucket_size_bytes
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            tcp = dist.TCPStore(master_address, master_port, is_master=False, timeout=timeout)
        except Exception as exc:  # torch raises several kinds
            raise RuntimeError(
                f"cannot reach the trainer's weight-transfer store at {master_address}:{master_port}: {exc}"
            ) from exc
        store = dist.PrefixStore(group_name, tcp)
        # Two workers given one rank would deadlock the group: say so instead.
        if store.add(f"rank/{rank}", 1) != 1:
            raise ValueError(
                f"rank {rank} was already taken by another worker: each server needs its own rank_offset"
            )
        try:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as exc:
            raise RuntimeError(f"joining the trainer's weight-transfer group (gloo) failed: {exc}") from exc
        self._tcp = tcp  # the group's store must outlive it

    def receive(
        self, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Every bucket of one update, as named tensors (CPU).

        Raises:
            ValueError: the metadata lists differ in length, or name an unknown dtype.
            RuntimeError: the group is closed, or a broadcast failed (the trainer left or timed out).
        """
        if self._group is None:
            raise RuntimeError("this weight receiver is closed; the trainer must initialize a new one")
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError(
                "update_info.names, dtype_names and shapes must have equal lengths "
                f"({len(names)}, {len(dtype_names)}, {len(shapes)})"
            )
        dtypes = [parse_dtype(name) for name in dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
        received: list[tuple[str, torch.Tensor]] = []
        for bucket in plan_buckets(sizes, self.bucket_size_bytes):
            buffer = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
            try:
                self._group.broadcast(buffer, TRAINER_RANK).wait()
            except Exception as exc:
                self.close()  # mid-bucket: only a new group is safe
                raise RuntimeError(f"receiving a weight bucket from the trainer failed: {exc}") from exc
            parts = buffer.split([sizes[i] for i in bucket])
            for i, part in zip(bucket, parts, strict=True):
                if part.storage_offset() % dtypes[i].itemsize:  # unaligned for its dtype: copy
                    part = part.clone()
                received.append((names[i], part.view(dtypes[i]).view(tuple(shapes[i]))))
        return received

    def close(self) -> None:
        """Leave the group. Idempotent."""
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            # Teardown of a broken group must not mask the error that broke it.
            with contextlib.suppress(Exception):
                group.shutdown()
