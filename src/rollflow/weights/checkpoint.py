"""``checkpoint``: weights travel as one safetensors file, for trainer and engines without a common process group.

Two transports:
- ``checkpoint_dir`` set: the sender writes ``<dir>/policy-<version>.safetensors`` (to a temporary name, then
  renamed, so a reader never sees half a file) and ``update_info["path"]`` names it. The directory must be
  visible to every server (same machine, or a shared filesystem).
- ``checkpoint_dir`` unset: the sender serves the file's bytes from a small HTTP endpoint in the trainer
  process and ``update_info["url"]`` names it (with an unguessable token); each server fetches it. Pulling
  rather than posting keeps the bytes out of ``/update_weights`` bodies (and their size limits).

The trainer side (``CheckpointTransport``, rank 0) writes or serves the file and reports where; the control half
(``CheckpointSender``) then has the servers read it. Only the newest file is kept: each push retires the files
of earlier ones (each push ends, the servers having loaded its file, before the next begins).

vLLM servers (``engine="vllm"``) read the file through rollflow's plugin engine (``rollflow.vllm_plugin``,
selected by ``--weight-transfer-config '{"backend": "rollflow_checkpoint"}'``), whose payloads declare only
``timeout_s`` (init) and ``path`` / ``url`` / ``policy_version`` (update). After each push to them the sender
checks delivery (``rollflow.weights.delivery``): every server serves the pushed version, and a few named
tensors with the digests rank 0 computed as it wrote the file (checked on vLLM 0.32.0).

This module imports no torch: trainer rank 0 writes or serves the file (``weights.trainer.checkpoint``), the
servers read it (``weights.server.checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    new_transfer_id,
)
from rollflow.weights.delivery import check_delivery, is_adapter_push, tensor_digests
from rollflow.weights.payloads import CheckpointInit, CheckpointUpdate, check_engine
from rollflow.weights.rounds import init_servers, open_transport

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)


class CheckpointStrategy(WeightTransferStrategy):
    """One safetensors file per policy version, through a shared directory or the trainer's HTTP endpoint.

    Args:
        checkpoint_dir: a directory every server can read; None serves the file over HTTP instead.
        host: address the HTTP endpoint binds and advertises (when ``checkpoint_dir`` is None).
        timeout_s: longest one push, or one server's read, may take.
        dtype: what floating weights are cast to before they are written (``weight_sync.dtype``).
        engine: the servers' kind: ``"torch"`` (``rollflow serve``) or ``"vllm"`` (the plugin engine's payloads,
            and a check of the served version and tensor digests after each push).
    """

    name = "checkpoint"

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        dtype: str = "auto",
        engine: str = "torch",
    ):
        self.engine = check_engine(engine)
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be positive, got {timeout_s}")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.host = host
        self.timeout_s = timeout_s
        self.dtype = check_transfer_dtype(dtype)

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        return dict(
            checkpoint_dir=sync.checkpoint_dir,
            host=master_address,
            timeout_s=sync.timeout_s,
            dtype=sync.dtype,
            engine=engine,
        )

    def create_sender(self, inference_world_size: int) -> CheckpointSender:
        # Every server reads the same file, so the number of workers does not change the payload.
        return CheckpointSender(inference_world_size, self)


class CheckpointSender(WeightSender):
    """Control half of ``checkpoint``: the trainer writes (or serves) the file, then the servers read it."""

    label = "checkpoint"
    how = "as a checkpoint"

    def __init__(self, inference_world_size: int, strategy: CheckpointStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.engine = strategy.engine
        self.transfer_id = new_transfer_id()
        directory = strategy.checkpoint_dir
        self.transport = CheckpointTransport(
            transfer_id=self.transfer_id,
            checkpoint_dir=None if directory is None else str(directory.resolve()),
            host=strategy.host,
            timeout_s=strategy.timeout_s,
            dtype=strategy.dtype,
            # The torch engine checks adapter pushes only (its /weight_checker reports adapters).
            digests=True,
        )

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await open_transport(
            self, source, TransportCall(self.transport, "open", {"release": list(release)}), self.timeout_s
        )
        self.init_info = CheckpointInit(timeout_s=self.timeout_s).encode_for(self.engine)
        await init_servers(self, control, "checkpoint", self.timeout_s)

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        location = dict(
            await source.run(TransportCall(self.transport, "push", {"policy_version": policy_version}))
        )
        digests = location.pop("digests", {})
        await control.start_weight_update()
        await control.update_weights(
            CheckpointUpdate(**location, policy_version=policy_version).encode_for(self.engine)
        )
        await control.finish_weight_update(policy_version)
        if self.engine == "vllm" or is_adapter_push(digests):
            await check_delivery(self, control, digests, policy_version)


@dataclass(frozen=True)
class CheckpointTransport:
    """Transport half of ``checkpoint`` (picklable): every rank iterates and gathers; rank 0 writes the file
    (or serves it from an HTTP endpoint in its own process) and reports where it is."""

    transfer_id: str
    checkpoint_dir: str | None
    host: str
    timeout_s: float
    dtype: str = "auto"
    # Rank 0 also reports digests of a few named tensors (``rollflow.weights.delivery``), for vLLM servers.
    digests: bool = False

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> None:
        from rollflow.weights.trainer.checkpoint import CheckpointSession
        from rollflow.weights.trainer.sessions import open_session, release_sessions

        release_sessions(release)
        if rank == 0:
            open_session(self.transfer_id, rank, lambda: CheckpointSession(self))

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> Any:
        """Rank 0 returns ``{"path": …}`` or ``{"url": …}`` (with ``"digests"`` when asked), and retires the
        files of earlier pushes (the servers have loaded them: each push ends before the next starts)."""
        from rollflow.weights.trainer.checkpoint import serialize
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != 0:
            for _ in weights:
                pass
            return None
        session = get_session(self.transfer_id, rank)
        if not self.digests:
            return session.publish(serialize(weights), policy_version)
        weights = list(weights)  # the same tensors serialize holds at once anyway
        return {**session.publish(serialize(weights), policy_version), "digests": tensor_digests(weights)}

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])
