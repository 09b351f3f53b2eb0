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
- ``BroadcastReceiver`` on each inference worker.

``/init_weight_transfer_engine`` and ``/update_weights`` block on the servers until the collective happens, so
they run concurrently with the trainer's side; both sides use the group's timeout, so a missing peer ends as an
error on each.

With ``engine="vllm"`` the payloads are exactly vLLM 0.33's (``NCCLWeightTransferInitInfo`` and
``NCCLWeightTransferUpdateInfo`` reject unknown keys) and the trainer side is vLLM's own NCCL rendezvous
(``rollflow.weights.vllm_nccl``): vLLM workers join a ``StatelessProcessGroup`` + PyNccl group, not ours.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from rollflow.errors import InvalidTransferInfoError, WeightTransferError, WeightTransferTimeoutError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    is_timeout,
    new_transfer_id,
)
from rollflow.weights.packing import (
    TensorSpec,
    pack,
    plan_buckets,
    specs_from_info,
    unpack,
)
from rollflow.weights.ranks import FIRST_WORKER_RANK, TRAINER_RANK, global_rank, per_server_init_infos
from rollflow.weights.rounds import check_world_size, open_transport, run_update_round, run_with_servers

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_SIZE_BYTES = 256 * 2**20
DEFAULT_GROUP_NAME = "rollflow-weights"
DEFAULT_TIMEOUT_S = 300.0
#: Buffers vLLM's packed broadcast keeps in flight (its ``packed_num_buffers``).
VLLM_PACKED_NUM_BUFFERS = 2
ENGINES = ("torch", "vllm")
#: Keys of an ``update_info`` that describe the tensors.
SPEC_KEYS = ("names", "dtype_names", "shapes")


def default_backend() -> str:
    """NCCL when this process sees a GPU, else gloo: what an ``init_info`` without ``backend`` means."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _create_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group over ``store`` without touching torch.distributed's default group. Blocks until every
    rank joined, or raises after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # NCCL connects lazily; a first tiny collective makes every rank wait for the others here.
        group.barrier().wait()
        return group
    raise InvalidTransferInfoError(
        f"init_info.backend must be 'gloo' or 'nccl' for a broadcast, got {backend!r}"
    )


class _Group:
    """A process group whose ``shutdown`` waits for the collective in flight: a timed-out collective runs on in
    an abandoned thread until the group's own timeout, and tearing the group down under it can crash."""

    def __init__(self, group: Any):
        self._group = group
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False

    def run(self, collective: Callable[[Any], None]) -> None:
        """``collective(group)`` on this thread, unless the group is closed."""
        with self._lock:
            if self._closed:
                raise WeightTransferError("the weight-transfer group is closed")
            self._busy += 1
        try:
            collective(self._group)
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closed and self._busy == 0
            if last:
                self._shutdown()

    def close(self) -> None:
        """Shut the group down now, or when its collective in flight ends. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._busy == 0
        if idle:
            self._shutdown()

    def _shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception as exc:  # teardown of a broken group must not mask the original error
                log.debug("weight group shutdown failed", error=str(exc))


def _timeout_error(what: str, timeout_s: float, exc: BaseException) -> WeightTransferTimeoutError:
    return WeightTransferTimeoutError(
        f"{what} did not complete within {timeout_s:g} s (a peer is missing or hung): {exc}"
    )


class BroadcastReceiver:
    """Inference-worker side: joins the group as rank ``rank_offset + worker_rank`` and receives buckets."""

    def __init__(self, init_info: dict[str, Any], worker_rank: int):
        try:
            # vLLM's payload has no backend, group_name or timeout_s: default them.
            self.backend = str(init_info.get("backend") or default_backend())
            address = str(init_info["master_address"])
            port = int(init_info["master_port"])
            self.world_size = int(init_info["world_size"])
            self.rank = global_rank(int(init_info.get("rank_offset", FIRST_WORKER_RANK)), int(worker_rank))
            self.bucket_size_bytes = int(init_info.get("packed_buffer_size_bytes", DEFAULT_BUCKET_SIZE_BYTES))
            self.timeout_s = float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S))
            group_name = str(init_info.get("group_name", DEFAULT_GROUP_NAME))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidTransferInfoError(
                f"broadcast init_info is missing or has a bad field: {exc!r}"
            ) from None
        if not 0 < self.rank < self.world_size:
            raise InvalidTransferInfoError(
                f"this worker's rank {self.rank} (rank_offset + worker_rank {worker_rank}) is outside 1.."
                f"{self.world_size - 1}: init_info.world_size {self.world_size} counts the trainer plus every "
                "inference worker; it was made for fewer workers than there are"
            )
        if self.bucket_size_bytes <= 0:
            raise InvalidTransferInfoError("init_info.packed_buffer_size_bytes must be positive")
        self._device = _device_for(self.backend)
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
            self._group = _Group(
                _create_group(self.backend, self._store, self.rank, self.world_size, self.timeout_s)
            )
        except InvalidTransferInfoError:
            raise
        except Exception as exc:
            if is_timeout(exc):
                raise _timeout_error("joining the weight-transfer group", self.timeout_s, exc) from exc
            raise WeightTransferError(f"joining the weight-transfer group failed: {exc}") from exc
        log.debug("weight receiver joined", rank=self.rank, world_size=self.world_size, backend=self.backend)

    def receive(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Receive every bucket of one update. All-empty metadata lists reuse the previous update's.

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
        specs = specs_from_info(update_info)
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
                    raise _timeout_error("receiving a weight bucket", self.timeout_s, exc) from exc
                raise WeightTransferError(f"receiving a weight bucket failed: {exc}") from exc
            received.extend(unpack(buffer, bucket_specs))
        return received

    def close(self) -> None:
        """Leave the group (once a receive in flight has ended). Idempotent."""
        self._group.close()


class BroadcastStrategy(WeightTransferStrategy):
    """Packed broadcast over a gloo (CPU) or NCCL (GPU) group of trainer rank 0 plus every inference worker.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks nccl when CUDA is available (always for vLLM), else gloo.
        bucket_size_mb: bytes per broadcast (MiB); bigger buckets mean fewer collectives, more memory.
        master_address: address trainer rank 0 binds its rendezvous on and the workers reach it at;
            127.0.0.1 unless they run elsewhere (``0.0.0.0`` binds every interface and advertises the host's
            address).
        timeout_s: longest a group formation or one update may take, on both sides.
        engine: the servers' kind: ``"torch"`` (``rollflow serve``: our group and payloads) or ``"vllm"``
            (vLLM 0.33's payload keys only, and vLLM's own NCCL rendezvous on the trainer side).
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
        if engine == "vllm" and backend not in (None, "nccl"):
            raise ValueError(
                f"vLLM servers receive weights by NCCL only; backend {backend!r} cannot reach them"
            )
        if backend is None:
            backend = "nccl" if engine == "vllm" else default_backend()
        if backend not in ("gloo", "nccl"):
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
        if self.engine == "vllm":
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
    """Control half of ``broadcast`` into ``rollflow serve`` servers."""

    label = "broadcast"
    bounds_itself = True  # each round step names what it waited on

    def __init__(self, inference_world_size: int, strategy: BroadcastStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.world_size = inference_world_size + 1
        self.transfer_id = new_transfer_id()
        self.transport = BroadcastTransport(
            transfer_id=self.transfer_id,
            backend=strategy.backend,
            master_address=strategy.master_address,
            world_size=self.world_size,
            bucket_size_bytes=strategy.bucket_size_bytes,
            timeout_s=strategy.timeout_s,
            dtype=strategy.dtype,
        )
        self._specs: dict[str, list] = {}

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await check_world_size(self, control, self.world_size)
        transport = self.transport
        opened = await open_transport(
            self, source, TransportCall(transport, "open", {"release": list(release)}), self.timeout_s
        )
        self._specs = {key: opened[key] for key in SPEC_KEYS}
        self.init_info = {
            "backend": transport.backend,
            "master_address": opened["master_address"],
            "master_port": opened["master_port"],
            "rank_offset": FIRST_WORKER_RANK,
            "world_size": self.world_size,
            "packed": True,
            "packed_buffer_size_bytes": transport.bucket_size_bytes,
            "group_name": transport.transfer_id,
            "timeout_s": transport.timeout_s,
        }
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
        log.debug("weight sender ready", world_size=self.world_size, backend=transport.backend)

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        if not self._specs:
            raise WeightTransferError("call setup(client, source) before push")
        await run_update_round(
            self,
            control,
            "broadcast",
            lambda: source.run(TransportCall(self.transport, "push")),
            {**self._specs, "policy_version": policy_version},
            policy_version,
            self.timeout_s,
        )


@dataclass(frozen=True)
class BroadcastTransport:
    """Transport half of ``broadcast`` (picklable; see the module docstring). Each method runs on one trainer
    rank with that rank's named weights; rank 0 owns the store and the group (a ``_BroadcastSession``)."""

    transfer_id: str
    backend: str
    master_address: str
    world_size: int
    bucket_size_bytes: int
    timeout_s: float
    dtype: str = "auto"

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> Any:
        """Release ``release``'s sessions; rank 0 binds the store and reports
        ``{master_address, master_port, names, dtype_names, shapes}``."""
        from rollflow.weights.trainer.sessions import (
            open_session,
            release_sessions,
            transfer_dtype,
            weight_specs,
        )

        release_sessions(release)
        if rank != TRAINER_RANK:
            return None
        session = open_session(self.transfer_id, rank, lambda: _BroadcastSession(self))
        specs = weight_specs(named_weights, transfer_dtype(self.dtype))
        session.specs = specs_from_info(specs)
        return {"master_address": session.address, "master_port": session.port, **specs}

    def join(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        """Rank 0 forms the group with every inference worker (blocks until they joined, or the timeout)."""
        from rollflow.weights.trainer.sessions import get_session

        if rank == TRAINER_RANK:
            get_session(self.transfer_id, rank).join()

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        """Every rank iterates (joining each gather); rank 0 broadcasts the buckets."""
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != TRAINER_RANK:
            for _ in weights:
                pass
            return
        get_session(self.transfer_id, rank).send(weights)

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])


class _BroadcastSession:
    """Rank 0's side of one connection: the store (bound on a free port at once, so no other process can take
    the port between picking and binding) and, once joined, the group."""

    def __init__(self, transport: BroadcastTransport):
        self.transport = transport
        self.address = advertised_address(transport.master_address)
        # Port 0: the OS picks a free port and the store holds it from now on.
        self._tcp_store: dist.TCPStore | None = dist.TCPStore(
            transport.master_address,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=transport.timeout_s),
        )
        self.port = self._tcp_store.port
        self._store = dist.PrefixStore(transport.transfer_id, self._tcp_store)
        self._group: _Group | None = None
        self.specs: list[TensorSpec] = []
        self.failed: str | None = None

    def join(self) -> None:
        if self._group is not None:
            return
        t = self.transport
        try:
            group = _create_group(t.backend, self._store, TRAINER_RANK, t.world_size, t.timeout_s)
        except Exception as exc:
            self.failed = f"its group never formed ({type(exc).__name__})"
            if is_timeout(exc):
                raise _timeout_error("forming the weight-transfer group", t.timeout_s, exc) from exc
            raise
        self._group = _Group(group)
        log.debug("weight transport joined", world_size=t.world_size, backend=t.backend)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.failed is not None:
            raise WeightTransferError(f"this weight transport is unusable: {self.failed}; reconnect")
        if self._group is None:
            raise WeightTransferError("the weight transport must join its group before a push")
        try:
            self._group.run(lambda group: self._broadcast(group, weights))
        except Exception as exc:
            self.failed = f"a push failed mid-transfer ({type(exc).__name__})"
            # Leave the group now: the servers blocked on this broadcast fail at once instead of at their
            # timeout, and the control half hears from them within its grace period.
            if self._group is not None:
                self._group.close()
            if is_timeout(exc):
                raise _timeout_error("broadcasting weights", self.transport.timeout_s, exc) from exc
            raise

    def _broadcast(self, group: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Buckets filled in iteration order until they hold ``bucket_size_bytes`` (``plan_buckets``'s rule,
        which the receivers follow from the metadata); each checked against the metadata sent at open."""
        device = _device_for(self.transport.backend)
        pending = None
        bucket: list[torch.Tensor] = []
        size = index = 0

        def flush() -> None:
            nonlocal pending
            # Pack the next bucket while the previous one is on the wire (two buffers in flight).
            buffer = pack(bucket, device)
            work = group.broadcast(buffer, TRAINER_RANK)
            if pending is not None:
                pending[0].wait()
            pending = (work, buffer)  # the buffer must outlive its broadcast

        for name, tensor in weights:
            spec = self.specs[index] if index < len(self.specs) else None
            if (
                spec is None
                or spec.name != name
                or spec.shape != tuple(tensor.shape)
                or spec.dtype != tensor.dtype
            ):
                raise WeightTransferError(
                    f"weight {index} is {name!r} {tuple(tensor.shape)} {tensor.dtype}, but the transport was "
                    f"opened for {spec}: the model changed since; reconnect"
                )
            index += 1
            bucket.append(tensor)
            size += spec.nbytes
            if size >= self.transport.bucket_size_bytes:
                flush()
                bucket, size = [], 0
        if index != len(self.specs):
            raise WeightTransferError(
                f"the trainer yielded {index} weights but the transport was opened for {len(self.specs)}"
            )
        if bucket:
            flush()
        if pending is not None:
            pending[0].wait()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._tcp_store = None
        self.failed = self.failed or "it was closed"
