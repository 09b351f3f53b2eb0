"""Trainer side of a broadcast into vLLM 0.33 servers (``broadcast`` with ``engine="vllm"``).

vLLM workers join the trainer through vLLM's own rendezvous (a ``StatelessProcessGroup`` hosted by rank 0 on
``master_port``, then a PyNccl communicator), and unpack buckets with vLLM's packed format, whose bucket
boundaries both sides must agree on. So this sender uses vLLM's own pieces for both: the same rendezvous as
vLLM's ``trainer_init`` and ``packed_nccl_broadcast_producer``. The HTTP side stays ours (the client's fan-out,
a per-server ``rank_offset``, the policy version as ``/finish_weight_update``'s ``weight_version``): vLLM's
``NCCLTrainerWeightTransferEngine`` drives the HTTP calls itself through a synchronous one-URL client with a
fixed ``rank_offset`` of 1, which cannot address several servers.

Payloads carry exactly vLLM's keys: ``init_info`` = ``NCCLWeightTransferInitInfo``'s fields, ``update_info`` =
``{names, dtype_names, shapes}``; vLLM rejects any other key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from rollflow.errors import MissingExtraError
from rollflow.weights.base import (
    WeightSender,
    WeightTransferError,
    server_init_infos,
)
from rollflow.weights.broadcast import TRAINER_RANK, check_world_size, run_update_round, run_with_http
from rollflow.weights.packing import dtype_name

log = structlog.get_logger(__name__)

#: The keys of vLLM 0.33's ``NCCLWeightTransferInitInfo`` (one rendezvous form) and update info.
VLLM_NCCL_INIT_KEYS = frozenset(
    {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }
)
VLLM_NCCL_UPDATE_KEYS = frozenset({"names", "dtype_names", "shapes"})


@dataclass(frozen=True)
class VllmTrainerApi:
    """The two vLLM calls the sender makes; a test substitutes fakes.

    ``join(address, port, world_size)`` forms the group as rank 0 (blocks until every worker joined) and
    returns it; ``send(named_tensors, group, buffer_size_bytes, num_buffers)`` broadcasts them packed.
    """

    join: Callable[[str, int, int], Any]
    send: Callable[[Iterable[tuple[str, torch.Tensor]], Any, int, int], None]


def load_vllm_trainer_api() -> VllmTrainerApi:
    """vLLM's trainer-side rendezvous and packed producer.

    Raises:
        MissingExtraError: vLLM (>= 0.33) is not installed.
        WeightTransferError: no CUDA device (NCCL needs one).
    """
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
    except ImportError as exc:
        raise MissingExtraError(
            f"a broadcast into vLLM servers needs vLLM >= 0.33 in the trainer: pip install 'rollflow[vllm]' ({exc})"
        ) from exc
    if not torch.cuda.is_available():
        raise WeightTransferError("a broadcast into vLLM servers needs CUDA in the trainer (NCCL)")

    def join(address: str, port: int, world_size: int) -> Any:
        group = StatelessProcessGroup.create(
            host=address, port=port, rank=TRAINER_RANK, world_size=world_size
        )
        return PyNcclCommunicator(group, device=torch.cuda.current_device())

    def send(
        named: Iterable[tuple[str, torch.Tensor]], group: Any, buffer_size: int, num_buffers: int
    ) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        packed_nccl_broadcast_producer(
            iterator=iter(named),
            group=group,
            src=TRAINER_RANK,
            # Moved to the GPU one tensor at a time, so a CPU state dict never needs a second full copy there.
            post_iter_func=lambda item: item[1].to(device),
            buffer_size_bytes=buffer_size,
            num_buffers=num_buffers,
        )

    return VllmTrainerApi(join=join, send=send)


def vllm_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """``NCCLWeightTransferUpdateInfo`` of ``named_tensors``, in their order (the order they are sent)."""
    named = list(named_tensors)
    return {
        "names": [name for name, _ in named],
        "dtype_names": [dtype_name(tensor.dtype) for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }


class VllmNcclSender(WeightSender):
    """Rank 0 of a vLLM weight-transfer group (see the module docstring).

    Args:
        init_info: from ``BroadcastStrategy(engine="vllm").create_init_info``.
        timeout_s: longest the group formation or one push may take.
        api: vLLM's trainer calls; None loads them on ``setup``.
    """

    def __init__(self, init_info: dict[str, Any], *, timeout_s: float, api: VllmTrainerApi | None = None):
        super().__init__(init_info)
        unknown = set(init_info) - VLLM_NCCL_INIT_KEYS
        if unknown:
            raise ValueError(f"vLLM's init_info takes no {sorted(unknown)} (it rejects unknown keys)")
        self.world_size = int(init_info["world_size"])
        self.timeout_s = timeout_s
        self._api = api
        self._group: Any = None

    async def setup(self, client: Any) -> None:
        api = self._api = self._api or load_vllm_trainer_api()
        await check_world_size(self, client, self.world_size)
        groups: list[Any] = []
        address, port = str(self.init_info["master_address"]), int(self.init_info["master_port"])
        try:
            payload = await server_init_infos(self.init_info, client)
            await run_with_http(
                "forming the vLLM weight-transfer group",
                lambda: groups.append(api.join(address, port, self.world_size)),
                client.init_weight_update_communicator(payload),
                self.timeout_s,
            )
        except BaseException:
            self.broken = "its process group never formed"
            raise
        self._group = groups[0]
        log.debug("vllm weight sender ready", world_size=self.world_size)

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        if self.broken is not None:
            raise WeightTransferError(f"this vLLM broadcast sender is unusable: {self.broken}; reconnect")
        if self._group is None or self._api is None:
            raise WeightTransferError("call setup(client) before push")
        api, group = self._api, self._group
        named = [(name, torch.as_tensor(value).detach()) for name, value in named_weights]
        buffer_size = int(self.init_info["packed_buffer_size_bytes"])
        num_buffers = int(self.init_info["packed_num_buffers"])
        # vLLM labels the weights with finish's weight_version; its update_info has no field for it.
        await run_update_round(
            self,
            client,
            "vLLM NCCL broadcast",
            lambda: api.send(named, group, buffer_size, num_buffers),
            vllm_update_info(named),
            policy_version,
            self.timeout_s,
        )

    def close(self) -> None:
        # PyNccl has no explicit teardown; dropping the communicator releases it (as vLLM's own shutdown).
        self._group = None
        self.broken = self.broken or "it was closed"
