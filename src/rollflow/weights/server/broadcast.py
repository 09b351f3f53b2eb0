"""The engine server's half of ``broadcast``: join the trainer's group and receive packed buckets (imports torch)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist

from rollflow.errors import InvalidTransferInfoError, WeightTransferError
from rollflow.weights.base import is_timeout
from rollflow.weights.groups import Group, create_group, device_for, timeout_error
from rollflow.weights.packing import TensorSpec, plan_buckets, specs_from_info, unpack
from rollflow.weights.payloads import BroadcastInit, TensorsUpdate, decode_update_info
from rollflow.weights.ranks import TRAINER_RANK, global_rank

log = structlog.get_logger(__name__)


class BroadcastReceiver:
    """Inference-worker side: joins the group as rank ``rank_offset + worker_rank`` and receives buckets."""

    def __init__(self, init_info: BroadcastInit, worker_rank: int):
        # vLLM's payload has no backend (the server's default), group_name or timeout_s (their defaults).
        self.backend = init_info.backend
        address, port = init_info.master_address, init_info.master_port
        self.world_size = init_info.world_size
        self.rank = global_rank(init_info.rank_offset, int(worker_rank))
        self.bucket_size_bytes = init_info.packed_buffer_size_bytes
        self.timeout_s = init_info.timeout_s
        group_name = init_info.group_name
        if not 0 < self.rank < self.world_size:
            raise InvalidTransferInfoError(
                f"this worker's rank {self.rank} (rank_offset + worker_rank {worker_rank}) is outside 1.."
                f"{self.world_size - 1}: init_info.world_size {self.world_size} counts the trainer plus every "
                "inference worker; it was made for fewer workers than there are"
            )
        if self.bucket_size_bytes <= 0:
            raise InvalidTransferInfoError("init_info.packed_buffer_size_bytes must be positive")
        self._device = device_for(self.backend)
        self._specs: list[TensorSpec] | None = None
        self._failed: str | None = None
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            tcp = dist.TCPStore(address, port, is_master=False, timeout=timeout)
        except Exception as exc:  # RuntimeError/DistStoreError: torch raises several kinds
            raise WeightTransferError(
                f"cannot reach the trainer's weight-transfer store at {address}:{port}: {exc}"
            ) from exc
        self._store = dist.PrefixStore(group_name, tcp)
        # Two servers given the same rank would deadlock the group; catch it here with a clear message.
        if self._store.add(f"rank/{self.rank}", 1) != 1:
            raise InvalidTransferInfoError(
                f"rank {self.rank} was already taken by another worker: give each server its own rank_offset "
                "(rollflow.weights.base.init_info_for_servers)"
            )
        try:
            self._group = Group(
                create_group(self.backend, self._store, self.rank, self.world_size, self.timeout_s)
            )
        except InvalidTransferInfoError:
            raise
        except Exception as exc:
            if is_timeout(exc):
                raise timeout_error("joining the weight-transfer group", self.timeout_s, exc) from exc
            raise WeightTransferError(f"joining the weight-transfer group failed: {exc}") from exc
        log.debug("weight receiver joined", rank=self.rank, world_size=self.world_size, backend=self.backend)

    def receive(self, update_info: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Receive every bucket of one update (a ``TensorsUpdate``). All-empty metadata lists reuse the previous
        update's.

        Raises:
            InvalidTransferInfoError: malformed metadata, or empty lists with no previous update.
            WeightTransferTimeoutError: the trainer did not send within the group's timeout.
            WeightTransferError: the receiver is closed or the collective failed.
        """
        if self._failed is not None:
            # The group may be mid-bucket; only a new group (a new init_info) is safe.
            raise WeightTransferError(
                f"this weight receiver failed earlier ({self._failed}); the trainer must initialize a new one"
            )
        specs = specs_from_info(decode_update_info(update_info, TensorsUpdate))
        if not specs:
            if self._specs is None:
                raise InvalidTransferInfoError(
                    "update_info has empty name lists but no earlier update to reuse"
                )
            specs = self._specs
        self._specs = specs
        received: list[tuple[str, torch.Tensor]] = []
        for bucket in plan_buckets(specs, self.bucket_size_bytes):
            bucket_specs = [specs[i] for i in bucket]
            buffer = torch.empty(sum(s.nbytes for s in bucket_specs), dtype=torch.uint8, device=self._device)
            try:
                self._group.run(lambda group, buffer=buffer: group.broadcast(buffer, TRAINER_RANK).wait())
            except WeightTransferError:
                raise
            except Exception as exc:
                self._failed = f"{type(exc).__name__}: {exc}"
                if is_timeout(exc):
                    raise timeout_error("receiving a weight bucket", self.timeout_s, exc) from exc
                raise WeightTransferError(f"receiving a weight bucket failed: {exc}") from exc
            received.extend(unpack(buffer, bucket_specs))
        return received

    def close(self) -> None:
        """Leave the group (once a receive in flight has ended). Idempotent."""
        self._group.close()
