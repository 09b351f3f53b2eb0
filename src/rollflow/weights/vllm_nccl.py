"""Both halves of a broadcast into vLLM 0.33 servers (``broadcast`` with ``engine="vllm"``).

vLLM workers join the trainer through vLLM's own rendezvous (a ``StatelessProcessGroup`` hosted by trainer rank 0
on a port it picks on its own host, then a PyNccl communicator), and unpack buckets with vLLM's packed format,
whose bucket boundaries both sides must agree on. So the transport half (``VllmNcclTransport``) uses vLLM's own
pieces for both: the same rendezvous as vLLM's ``trainer_init`` and ``packed_nccl_broadcast_producer``. The HTTP side stays ours (the client's fan-out,
a per-server ``rank_offset``, the policy version as ``/finish_weight_update``'s ``weight_version``): vLLM's
``NCCLTrainerWeightTransferEngine`` drives the HTTP calls itself through a synchronous one-URL client with a
fixed ``rank_offset`` of 1, which cannot address several servers.

Payloads carry exactly vLLM's keys: ``init_info`` = ``NCCLWeightTransferInitInfo``'s fields, ``update_info`` =
``{names, dtype_names, shapes}``; vLLM rejects any other key.

This module imports no torch: vLLM's trainer calls run on trainer rank 0 (``weights.trainer.vllm_nccl``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.errors import WeightTransferError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    new_transfer_id,
)
from rollflow.weights.broadcast import SPEC_KEYS, advertised_address
from rollflow.weights.payloads import (
    VLLM_PACKED_NUM_BUFFERS,
    NcclInit,
    TensorsUpdate,
)
from rollflow.weights.ranks import TRAINER_RANK, per_server_init_infos
from rollflow.weights.rounds import check_world_size, open_transport, run_update_round, run_with_servers

if TYPE_CHECKING:
    import torch

    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class VllmTrainerApi:
    """The two vLLM calls the sender makes; a test substitutes fakes.

    ``join(address, port, world_size)`` forms the group as rank 0 (blocks until every worker joined) and
    returns it; ``send(named_tensors, group, buffer_size_bytes, num_buffers)`` broadcasts them packed.
    """

    join: Callable[[str, int, int], Any]
    send: Callable[[Iterable[tuple[str, torch.Tensor]], Any, int, int], None]


class VllmNcclSender(WeightSender):
    """Control half of a broadcast into vLLM servers (see the module docstring).

    Args:
        inference_world_size: the servers' workers in all.
        master_address: where trainer rank 0 hosts vLLM's rendezvous.
        bucket_size_bytes: vLLM's ``packed_buffer_size_bytes``.
        timeout_s: longest the group formation or one push may take.
        dtype: what floating weights are cast to before they travel (``weight_sync.dtype``).
        api: vLLM's trainer calls (a fake in tests; not picklable then, so in-process trainers only); None
            loads vLLM's on the trainer side.
    """

    label = "vLLM broadcast"
    bounds_itself = True  # each round step names what it waited on

    def __init__(
        self,
        inference_world_size: int,
        *,
        master_address: str = "127.0.0.1",
        bucket_size_bytes: int,
        timeout_s: float,
        dtype: str = "auto",
        api: VllmTrainerApi | None = None,
    ):
        super().__init__(inference_world_size, timeout_s)
        self.world_size = inference_world_size + 1
        self.transfer_id = new_transfer_id()
        self.transport = VllmNcclTransport(
            transfer_id=self.transfer_id,
            master_address=master_address,
            world_size=self.world_size,
            buffer_size_bytes=bucket_size_bytes,
            num_buffers=VLLM_PACKED_NUM_BUFFERS,
            dtype=dtype,
            api=api,
        )
        self._update_info: dict[str, Any] = {}

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await check_world_size(self, control, self.world_size)
        transport = self.transport
        opened = await open_transport(
            self, source, TransportCall(transport, "open", {"release": list(release)}), self.timeout_s
        )
        self._update_info = TensorsUpdate(**{key: opened[key] for key in SPEC_KEYS}).encode_for("vllm")
        self.init_info = NcclInit(
            master_address=opened["master_address"],
            master_port=opened["master_port"],
            world_size=self.world_size,
            packed_buffer_size_bytes=transport.buffer_size_bytes,
            packed_num_buffers=transport.num_buffers,
        ).encode_for("vllm")
        try:
            payloads = per_server_init_infos(self.init_info, await control.world_size())
            await run_with_servers(
                "forming the vLLM weight-transfer group",
                lambda: source.run(TransportCall(transport, "join")),
                lambda: control.init_weight_transfer(payloads),
                self.timeout_s,
                servers=control.server_urls,
            )
        except BaseException:
            self.broken = "its process group never formed"
            raise
        log.debug("vllm weight sender ready", world_size=self.world_size)

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        if not self._update_info:
            raise WeightTransferError("call setup(client, source) before push")
        # vLLM labels the weights with finish's weight_version; its update_info has no field for it.
        await run_update_round(
            self,
            control,
            "vLLM NCCL broadcast",
            lambda: source.run(TransportCall(self.transport, "push")),
            self._update_info,
            policy_version,
            self.timeout_s,
        )


@dataclass(frozen=True)
class VllmNcclTransport:
    """Transport half of a broadcast into vLLM servers (picklable unless ``api`` is a fake): rank 0 picks a
    free port on its host, hosts vLLM's rendezvous there and sends with vLLM's packed producer; every rank
    iterates (joining each gather)."""

    transfer_id: str
    master_address: str
    world_size: int
    buffer_size_bytes: int
    num_buffers: int
    dtype: str = "auto"
    api: VllmTrainerApi | None = None

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> Any:
        """Rank 0 reports ``{master_address, master_port, names, dtype_names, shapes}``."""
        from rollflow.weights.trainer.sessions import (
            open_session,
            release_sessions,
            transfer_dtype,
            weight_specs,
        )
        from rollflow.weights.trainer.vllm_nccl import VllmSession

        release_sessions(release)
        if rank != TRAINER_RANK:
            return None
        session = open_session(self.transfer_id, rank, lambda: VllmSession(self))
        specs = weight_specs(named_weights, transfer_dtype(self.dtype))
        return {
            "master_address": advertised_address(self.master_address),
            "master_port": session.port,
            **specs,
        }

    def join(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import get_session

        if rank == TRAINER_RANK:
            session = get_session(self.transfer_id, rank)
            session.group = session.api.join(self.master_address, session.port, self.world_size)

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != TRAINER_RANK:
            for _ in weights:
                pass
            return
        session = get_session(self.transfer_id, rank)
        if session.group is None:
            raise WeightTransferError("the vLLM weight transport must join its group before a push")
        session.api.send(weights, session.group, self.buffer_size_bytes, self.num_buffers)

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])
