"""``broadcast``: the trainer (rank 0) broadcasts packed weight buckets to every inference worker.

The group is a standalone one built from its own ``TCPStore`` (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL``
on GPU), never ``init_process_group``: it does not touch the default group a trainer may already have (FSDP),
and two transfers never collide because each ``init_info`` names a fresh store prefix (``group_name``).

The trainer hosts the store: ``create_init_info`` binds it on a free port right away (so no other process can
take the port between picking and binding). ``/init_weight_transfer_engine`` and ``/update_weights`` block on
the servers until the broadcast happens, so the sender runs those HTTP calls as tasks while its own side of the
collective runs in a thread. Both sides use the group's timeout, so a missing peer ends as an error on each.

With ``engine="vllm"`` the payloads are exactly vLLM 0.33's (``NCCLWeightTransferInitInfo`` and
``NCCLWeightTransferUpdateInfo`` reject unknown keys) and the trainer side is vLLM's own NCCL rendezvous
(``rollflow.weights.vllm_nccl``): vLLM workers join a ``StatelessProcessGroup`` + PyNccl group, not ours.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import structlog
import torch
import torch.distributed as dist

from rollflow.weights.base import (
    InvalidTransferInfoError,
    WeightSender,
    WeightTransferError,
    WeightTransferStrategy,
    WeightTransferTimeoutError,
    server_init_infos,
)
from rollflow.weights.packing import (
    TensorSpec,
    pack,
    plan_buckets,
    specs_from_info,
    specs_of,
    specs_to_info,
    unpack,
)

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_SIZE_BYTES = 256 * 2**20
DEFAULT_GROUP_NAME = "rollflow-weights"
DEFAULT_TIMEOUT_S = 300.0
TRAINER_RANK = 0
#: Buffers vLLM's packed broadcast keeps in flight (its ``packed_num_buffers``).
VLLM_PACKED_NUM_BUFFERS = 2
ENGINES = ("torch", "vllm")


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


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first non-cancellation error in a task group's exception group: the one worth reporting (the
    other task was cancelled because of it)."""
    leaves: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        else:
            leaves.append(exc)

    collect(group)
    cancelled = anyio.get_cancelled_exc_class()
    return next((exc for exc in leaves if not isinstance(exc, cancelled)), leaves[0])


class BroadcastReceiver:
    """Inference-worker side: joins the group as rank ``rank_offset + worker_rank`` and receives buckets."""

    def __init__(self, init_info: dict[str, Any], worker_rank: int):
        try:
            # vLLM's payload has no backend, group_name or timeout_s: default them.
            self.backend = str(init_info.get("backend") or default_backend())
            address = str(init_info["master_address"])
            port = int(init_info["master_port"])
            self.world_size = int(init_info["world_size"])
            self.rank = int(init_info.get("rank_offset", 1)) + int(worker_rank)
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
            if _is_timeout(exc):
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
                if _is_timeout(exc):
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
        master_address: address the workers reach the trainer's store at; 127.0.0.1 unless they run elsewhere.
        timeout_s: longest a group formation or one update may take, on both sides.
        engine: the servers' kind: ``"torch"`` (``rollflow serve``: our group and payloads) or ``"vllm"``
            (vLLM 0.33's payload keys only, and vLLM's own NCCL rendezvous on the trainer side).
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
        self._stores: dict[int, dist.TCPStore] = {}

    def create_init_info(self, inference_world_size: int) -> dict[str, Any]:
        if inference_world_size < 1:
            raise ValueError(f"inference_world_size must be >= 1, got {inference_world_size}")
        if self.engine == "vllm":
            return self._vllm_init_info(inference_world_size)
        # Port 0: the OS picks a free port and the store holds it from now on.
        store = dist.TCPStore(
            self.master_address,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self._stores[store.port] = store
        return {
            "backend": self.backend,
            "master_address": self.master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": inference_world_size + 1,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_size_bytes,
            "group_name": f"rollflow-weights-{secrets.token_hex(8)}",
            "timeout_s": self.timeout_s,
        }

    def _vllm_init_info(self, inference_world_size: int) -> dict[str, Any]:
        """Exactly ``NCCLWeightTransferInitInfo``'s fields (vLLM rejects any other key)."""
        # vLLM's rendezvous binds its own store on this port when the sender sets up, so it can only be
        # picked here, not held (a small window in which another process could take it).
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((self.master_address, 0))
            port = probe.getsockname()[1]
        return {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": inference_world_size + 1,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_size_bytes,
            "packed_num_buffers": VLLM_PACKED_NUM_BUFFERS,
        }

    def create_sender(self, init_info: dict[str, Any]) -> WeightSender:
        if self.engine == "vllm":
            from rollflow.weights.vllm_nccl import VllmNcclSender

            return VllmNcclSender(init_info, timeout_s=self.timeout_s)
        store = self._stores.pop(int(init_info["master_port"]), None)
        if store is None:
            raise ValueError(
                "init_info was not created by this BroadcastStrategy (or its sender exists already)"
            )
        return BroadcastSender(init_info, store)


async def check_world_size(sender: WeightSender, client: Any, world_size: int) -> None:
    """Fail (and mark ``sender`` broken) unless the servers report ``world_size - 1`` workers.

    Raises:
        WeightTransferError: the servers report another world size.
    """
    inference_world_size = await client.get_world_size()
    if inference_world_size + 1 != world_size:
        sender.broken = "its init_info does not match the servers' world size"
        raise WeightTransferError(
            f"the inference servers report {inference_world_size} workers but this init_info was made for "
            f"{world_size - 1} (world_size {world_size} includes the trainer); "
            "create it from client.get_world_size()"
        )


async def run_with_http(what: str, collective: Callable[[], None], http_call: Any, timeout_s: float) -> None:
    """Run the blocking ``collective`` in a thread while ``http_call`` (which blocks on the servers until the
    collective happens) runs as a task; fail when either fails, within ``timeout_s``.

    Raises:
        WeightTransferTimeoutError: either side took longer than ``timeout_s``.
        Exception: the first failure of either side.
    """

    async def call_servers() -> None:
        await http_call

    try:
        with anyio.fail_after(timeout_s):
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call_servers)
                    # abandon_on_cancel: a hung collective must not keep the caller; its thread ends at the
                    # group timeout on its own.
                    await anyio.to_thread.run_sync(collective, abandon_on_cancel=True)
            except BaseExceptionGroup as group:
                raise _first_error(group) from None
    except TimeoutError as exc:
        raise WeightTransferTimeoutError(f"{what} took longer than {timeout_s:g} s") from exc
    except Exception as exc:
        if _is_timeout(exc):
            raise _timeout_error(what, timeout_s, exc) from exc
        raise


async def run_update_round(
    sender: WeightSender,
    client: Any,
    how: str,
    collective: Callable[[], None],
    update_info: dict[str, Any],
    policy_version: int,
    timeout_s: float,
) -> None:
    """One update of a collective transfer: ``/start_weight_update``, then ``/update_weights`` together with
    the trainer's side of the ``collective``, then ``/finish_weight_update`` labelling ``policy_version``; all
    within ``timeout_s``. Any failure marks ``sender`` broken: the group may be mid-bucket.

    Raises:
        WeightTransferTimeoutError: the round took longer than ``timeout_s``.
    """
    try:
        with anyio.fail_after(timeout_s):
            await client.start_weight_update()
            await run_with_http(
                f"broadcasting weights ({how})",
                collective,
                client.update_named_weights(update_info),
                timeout_s,
            )
            await client.finish_weight_update(weight_version=policy_version)
    except TimeoutError as exc:
        sender.broken = f"policy version {policy_version} timed out mid-transfer"
        raise WeightTransferTimeoutError(
            f"pushing policy version {policy_version} by {how} took longer than {timeout_s:g} s"
        ) from exc
    except BaseException as exc:
        sender.broken = f"pushing policy version {policy_version} failed ({type(exc).__name__})"
        raise


class BroadcastSender(WeightSender):
    """Trainer side of ``broadcast``: rank 0 of the group, and host of its store."""

    def __init__(self, init_info: dict[str, Any], store: dist.TCPStore):
        super().__init__(init_info)
        self.backend = init_info.get("backend") or default_backend()
        self.world_size = int(init_info["world_size"])
        self.bucket_size_bytes = int(init_info.get("packed_buffer_size_bytes", DEFAULT_BUCKET_SIZE_BYTES))
        self.timeout_s = float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S))
        self._tcp_store: dist.TCPStore | None = store
        self._store = dist.PrefixStore(init_info.get("group_name", DEFAULT_GROUP_NAME), store)
        self._group: _Group | None = None

    async def setup(self, client: Any) -> None:
        await check_world_size(self, client, self.world_size)
        group: list[Any] = []

        def join() -> None:
            group.append(
                _create_group(self.backend, self._store, TRAINER_RANK, self.world_size, self.timeout_s)
            )

        try:
            payload = await server_init_infos(self.init_info, client)
            await run_with_http(
                "forming the weight-transfer group",
                join,
                client.init_weight_update_communicator(payload),
                self.timeout_s,
            )
        except BaseException:
            self.broken = "its process group never formed"
            raise
        self._group = _Group(group[0])
        log.debug("weight sender ready", world_size=self.world_size, backend=self.backend)

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        if self.broken is not None:
            raise WeightTransferError(
                f"this broadcast sender is unusable: {self.broken}; close it and reconnect"
            )
        if self._group is None:
            raise WeightTransferError("call setup(client) before push")
        group = self._group
        tensors = [(name, torch.as_tensor(value).detach()) for name, value in named_weights]
        specs = specs_of(tensors)
        update_info = {**specs_to_info(specs), "policy_version": policy_version}
        await run_update_round(
            self,
            client,
            "broadcast",
            lambda: group.run(lambda pg: self._broadcast(pg, tensors, specs)),
            update_info,
            policy_version,
            self.timeout_s,
        )

    def _broadcast(
        self, group: Any, tensors: list[tuple[str, torch.Tensor]], specs: list[TensorSpec]
    ) -> None:
        device = _device_for(self.backend)
        pending = None
        for bucket in plan_buckets(specs, self.bucket_size_bytes):
            # Pack the next bucket while the previous one is on the wire (two buffers in flight).
            buffer = pack([tensors[i][1] for i in bucket], device)
            work = group.broadcast(buffer, TRAINER_RANK)
            if pending is not None:
                pending[0].wait()
            pending = (work, buffer)  # the buffer must outlive its broadcast
        if pending is not None:
            pending[0].wait()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._tcp_store = None
        self.broken = self.broken or "it was closed"
