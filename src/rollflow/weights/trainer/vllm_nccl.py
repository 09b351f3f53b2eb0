"""Trainer rank 0's half of a broadcast into vLLM servers: vLLM's rendezvous and packed producer (imports
torch; vLLM on first use).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from rollflow.errors import MissingExtraError, WeightTransferError
from rollflow.weights.ranks import TRAINER_RANK
from rollflow.weights.vllm_nccl import VllmTrainerApi

if TYPE_CHECKING:
    from rollflow.weights.vllm_nccl import VllmNcclTransport


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


class VllmSession:
    """Rank 0's vLLM calls, its rendezvous port and, once joined, the communicator."""

    def __init__(self, transport: VllmNcclTransport):
        self.api: VllmTrainerApi = transport.api or load_vllm_trainer_api()
        # vLLM's rendezvous binds its own store on this port when the group forms, so it can only be picked
        # here, not held (a small window in which another process could take it).
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((transport.master_address, 0))
            self.port = probe.getsockname()[1]
        self.group: Any = None

    def close(self) -> None:
        # PyNccl has no explicit teardown; dropping the communicator releases it (as vLLM's own shutdown).
        self.group = None
