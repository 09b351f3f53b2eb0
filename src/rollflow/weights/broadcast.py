"""``broadcast``: trainer rank 0 broadcasts packed weight buckets to every inference worker.

The group is a standalone one built from its own ``TCPStore`` (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL``
on GPU), never ``init_process_group``: it does not touch the default group a trainer may already have (FSDP),
and two transfers never collide because each connection names a fresh store prefix (``group_name``).

Three parts (see ``rollflow.weights.base``):
- ``BroadcastSender``, the control half in the orchestrator: asks the servers' world size, has the trainer
  open the transport, sends ``init_info`` with the rendezvous the trainer reported, and per push runs
  ``/update_weights`` as a task while the trainer pushes.
- ``BroadcastTransport``, the transport half on every trainer rank: ``open`` (rank 0 binds the store on a free
  port of its own host and reports it with the weights' metadata), ``join`` (rank 0 forms the group with the
  servers), ``push`` (every rank iterates and gathers, rank 0 packs and broadcasts).
- ``BroadcastReceiver`` on each inference worker (``rollflow.weights.server.broadcast``).

This module imports no torch: what touches torch.distributed runs on the trainer ranks
(``rollflow.weights.trainer.broadcast``) and in the servers (``rollflow.weights.server.broadcast``).

``/init_weight_transfer_engine`` and ``/update_weights`` block on the servers until the collective happens, so
they run concurrently with the trainer's side; both sides use the group's timeout, so a missing peer ends as an
error on each.

With ``engine="vllm"`` and NCCL the payloads are exactly vLLM 0.33's (``NCCLWeightTransferInitInfo`` and
``NCCLWeightTransferUpdateInfo`` reject unknown keys) and the trainer side is vLLM's own NCCL rendezvous
(``rollflow.weights.vllm_nccl``): vLLM workers join a ``StatelessProcessGroup`` + PyNccl group, not ours.
With ``engine="vllm"`` and gloo the vLLM workers join our group through rollflow's plugin engine
(``rollflow.vllm_plugin``, a server started with ``--weight-transfer-config '{"backend": "rollflow"}'``; the
trainer needs no vLLM), and after each push the sender checks delivery (``rollflow.weights.delivery``): every
server serves the pushed version, and a few named tensors with the digests rank 0 computed as it sent them
(checked on vLLM 0.32.0).
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from rollflow.errors import WeightTransferError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    new_transfer_id,
)
from rollflow.weights.delivery import check_delivery, is_adapter_name, is_adapter_push, tensor_digests
from rollflow.weights.payloads import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooInit,
    NcclInit,
    TensorsUpdate,
)
from rollflow.weights.ranks import TRAINER_RANK, per_server_init_infos
from rollflow.weights.rounds import check_world_size, open_transport, run_update_round, run_with_servers

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)

ENGINES = ("torch", "vllm")
#: Keys of an ``update_info`` that describe the tensors.
SPEC_KEYS = ("names", "dtype_names", "shapes")


class BroadcastStrategy(WeightTransferStrategy):
    """Packed broadcast over a gloo (CPU) or NCCL (GPU) group of trainer rank 0 plus every inference worker.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks nccl for vLLM, else nccl when trainer rank 0 sees a GPU
            and gloo when it does not (decided there, when the transport opens: the orchestrator needs no torch).
            vLLM servers take gloo through rollflow's plugin engine only (``rollflow.vllm_plugin``).
        bucket_size_mb: bytes per broadcast (MiB); bigger buckets mean fewer collectives, more memory.
        master_address: address trainer rank 0 binds its rendezvous on and the workers reach it at;
            127.0.0.1 unless they run elsewhere (``0.0.0.0`` binds every interface and advertises the host's
            address).
        timeout_s: longest a group formation or one update may take, on both sides.
        engine: the servers' kind: ``"torch"`` (``rollflow serve``: our group and payloads) or ``"vllm"``
            (NCCL: vLLM 0.33's payload keys only, and vLLM's own NCCL rendezvous on the trainer side; gloo: our
            group, the plugin engine's payload keys, and proof of delivery after each push).
        dtype: what floating weights are cast to before they travel (``weight_sync.dtype``; ``auto``: as the
            trainer holds them).
    """

    name = "broadcast"

    def __init__(
        self,
        *,
        backend: str | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_BYTES / 2**20,
        master_address: str = "127.0.0.1",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        engine: str = "torch",
        dtype: str = "auto",
    ):
        if engine not in ENGINES:
            raise ValueError(
                f"broadcast engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}"
            )
        if backend is None and engine == "vllm":
            backend = "nccl"
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"broadcast backend must be 'gloo' or 'nccl', got {backend!r}")
        if bucket_size_mb <= 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be positive, got {bucket_size_mb}")
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be positive, got {timeout_s}")
        self.backend = backend
        self.bucket_size_bytes = max(1, int(bucket_size_mb * 2**20))
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.engine = engine
        self.dtype = check_transfer_dtype(dtype)

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        return dict(
            bucket_size_mb=sync.bucket_size_mb,
            backend=sync.backend,
            master_address=master_address,
            timeout_s=sync.timeout_s,
            engine=engine,
            dtype=sync.dtype,
        )

    def create_sender(self, inference_world_size: int) -> WeightSender:
        if inference_world_size < 1:
            raise ValueError(f"inference_world_size must be >= 1, got {inference_world_size}")
        if self.engine == "vllm" and self.backend == "nccl":
            from rollflow.weights.vllm_nccl import VllmNcclSender

            return VllmNcclSender(
                inference_world_size,
                master_address=self.master_address,
                bucket_size_bytes=self.bucket_size_bytes,
                timeout_s=self.timeout_s,
                dtype=self.dtype,
            )
        return BroadcastSender(inference_world_size, self)


def advertised_address(address: str) -> str:
    """The address peers reach a listener bound to ``address`` at: the host's own for the wildcard."""
    if address in ("", "0.0.0.0"):
        return socket.gethostbyname(socket.gethostname())
    return address


class BroadcastSender(WeightSender):
    """Control half of ``broadcast`` into ``rollflow serve`` servers, and of a gloo broadcast into vLLM servers
    (``strategy.engine == "vllm"``: the plugin engine's payloads, and proof of delivery after each push)."""

    label = "broadcast"
    bounds_itself = True  # each round step names what it waited on

    def __init__(self, inference_world_size: int, strategy: BroadcastStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.world_size = inference_world_size + 1
        self.engine = strategy.engine
        self.transfer_id = new_transfer_id()
        self.transport = BroadcastTransport(
            transfer_id=self.transfer_id,
            backend=strategy.backend,
            master_address=strategy.master_address,
            world_size=self.world_size,
            bucket_size_bytes=strategy.bucket_size_bytes,
            timeout_s=strategy.timeout_s,
            dtype=strategy.dtype,
            digests=self.engine == "vllm",
        )
        self._specs: dict[str, list] = {}

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await check_world_size(self, control, self.world_size)
        transport = self.transport
        opened = await open_transport(
            self, source, TransportCall(transport, "open", {"release": list(release)}), self.timeout_s
        )
        self._specs = {key: opened[key] for key in SPEC_KEYS}
        init = NcclInit if opened["backend"] == "nccl" else GlooInit
        self.init_info = init(
            master_address=opened["master_address"],
            master_port=opened["master_port"],
            world_size=self.world_size,
            packed_buffer_size_bytes=transport.bucket_size_bytes,
            group_name=transport.transfer_id,
            timeout_s=transport.timeout_s,
        ).encode_for(self.engine)
        try:
            payloads = per_server_init_infos(self.init_info, await control.world_size())
            await run_with_servers(
                "forming the weight-transfer group",
                lambda: source.run(TransportCall(transport, "join")),
                lambda: control.init_weight_transfer(payloads),
                self.timeout_s,
                servers=control.server_urls,
            )
        except BaseException:
            self.broken = "its process group never formed"
            raise
        log.debug("weight sender ready", world_size=self.world_size, backend=opened["backend"])

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        if not self._specs:
            raise WeightTransferError("call setup(client, source) before push")
        digests = await run_update_round(
            self,
            control,
            "broadcast",
            lambda: source.run(TransportCall(self.transport, "push")),
            TensorsUpdate(**self._specs, policy_version=policy_version).encode_for(self.engine),
            policy_version,
            self.timeout_s,
        )
        if self.engine == "vllm" or is_adapter_push(digests or {}):  # rollflow.weights.delivery
            with anyio.fail_after(self.timeout_s):
                await check_delivery(self, control, digests or {}, policy_version)


@dataclass(frozen=True)
class BroadcastTransport:
    """Transport half of ``broadcast`` (picklable; see the module docstring). Each method runs on one trainer
    rank with that rank's named weights; rank 0 owns the store and the group (a ``BroadcastSession`` of
    ``rollflow.weights.trainer.broadcast``). ``backend`` None: rank 0's default (nccl with a GPU, else gloo)."""

    transfer_id: str
    backend: str | None
    master_address: str
    world_size: int
    bucket_size_bytes: int
    timeout_s: float
    dtype: str = "auto"
    # Rank 0's push also reports digests of a few named tensors (``rollflow.weights.delivery``), for vLLM.
    digests: bool = False

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> Any:
        """Release ``release``'s sessions; rank 0 binds the store and reports
        ``{backend, master_address, master_port, names, dtype_names, shapes}``."""
        from rollflow.weights.packing import specs_from_info
        from rollflow.weights.trainer.broadcast import BroadcastSession
        from rollflow.weights.trainer.sessions import (
            open_session,
            release_sessions,
            transfer_dtype,
            weight_specs,
        )

        release_sessions(release)
        if rank != TRAINER_RANK:
            return None
        session = open_session(self.transfer_id, rank, lambda: BroadcastSession(self))
        specs = weight_specs(named_weights, transfer_dtype(self.dtype))
        session.specs = specs_from_info(specs)
        return {
            "backend": session.backend,
            "master_address": session.address,
            "master_port": session.port,
            **specs,
        }

    def join(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        """Rank 0 forms the group with every inference worker (blocks until they joined, or the timeout)."""
        from rollflow.weights.trainer.sessions import get_session

        if rank == TRAINER_RANK:
            get_session(self.transfer_id, rank).join()

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> dict[str, list[str]] | None:
        """Every rank iterates (joining each gather); rank 0 broadcasts the buckets, and returns the digests of
        a few of the tensors it sent (``rollflow.weights.delivery``) when asked, or of the adapter for a LoRA
        push (else None)."""
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != TRAINER_RANK:
            for _ in weights:
                pass
            return None
        session = get_session(self.transfer_id, rank)
        first = next(weights, None)
        weights = itertools.chain([] if first is None else [first], weights)
        if first is not None and is_adapter_name(first[0]):
            adapter = list(weights)  # a few MB: kept for the digests
            session.send(iter(adapter))
            return tensor_digests(adapter)
        if not self.digests:
            session.send(weights)
            return None
        vectors: list[tuple[str, Any]] = []  # the digest candidates: small, kept as they stream past

        def keeping_vectors() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if tensor.ndim == 1 and tensor.is_floating_point():
                    vectors.append((name, tensor))
                yield name, tensor

        session.send(keeping_vectors())
        return tensor_digests(vectors)

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])
