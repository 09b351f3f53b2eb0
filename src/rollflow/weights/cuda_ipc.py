"""``cuda_ipc``: trainer and engine share a GPU; the engine maps the trainer's packed buffers by CUDA IPC handle.

Per bucket the trainer side (``CudaIpcTransport``, rank 0) packs tensors into one CUDA ``uint8`` buffer, exports
its IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) keyed by the GPU's UUID, and reports it; the
control half (``CudaIpcSender``) sends it in one ``/update_weights`` call (vLLM's ``ipc_handles_pickled`` and
``tensor_sizes``). The buffer stays alive until that call returned (the trainer frees it when asked for the next
bucket), and the receiver copies out of it before returning.

The handle is pickled (base64) like vLLM's; the receiver unpickles with an allow-list of torch names only,
since the payload comes over HTTP. Needs CUDA on both sides; the inference world size is accepted and ignored
(every colocated engine maps the same buffer).

With ``engine="vllm"`` the payloads are exactly vLLM 0.33's IPC shape: ``init_info`` = ``{"packed": true}``,
``update_info`` = ``{names, dtype_names, shapes, tensor_sizes, ipc_handles_pickled}`` (vLLM's packed form: one
``{gpu_uuid: handle}`` per call); the policy version goes only to ``/finish_weight_update``.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

from rollflow.errors import InvalidTransferInfoError, WeightTransferError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    new_transfer_id,
)
from rollflow.weights.packing import (
    TensorSpec,
    pack,
    specs_from_info,
    specs_of,
    specs_to_info,
    unpack,
)
from rollflow.weights.rounds import init_servers, open_transport

DEFAULT_BUCKET_SIZE_BYTES = 512 * 2**20


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Resolves only names from torch modules: enough for ``reduce_tensor``'s output, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from an IPC handle")


class CudaIpcStrategy(WeightTransferStrategy):
    """Colocated GPU transfer by CUDA IPC handles.

    Args:
        bucket_size_mb: size of each packed buffer (MiB); each costs that much extra GPU memory while sent.
        timeout_s: longest one push may take.
        engine: ``"torch"`` (rollflow servers) or ``"vllm"`` (vLLM 0.33's payload keys only).
        dtype: what floating weights are cast to before they are packed (``weight_sync.dtype``).
    """

    name = "cuda_ipc"

    def __init__(
        self,
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_BYTES / 2**20,
        timeout_s: float = 300.0,
        engine: str = "torch",
        dtype: str = "auto",
    ):
        if bucket_size_mb <= 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be positive, got {bucket_size_mb}")
        if engine not in ("torch", "vllm"):
            raise ValueError(f"cuda_ipc engine must be 'torch' or 'vllm', got {engine!r}")
        self.bucket_size_bytes = max(1, int(bucket_size_mb * 2**20))
        self.timeout_s = timeout_s
        self.engine = engine
        self.dtype = check_transfer_dtype(dtype)

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        return dict(
            bucket_size_mb=sync.bucket_size_mb, timeout_s=sync.timeout_s, engine=engine, dtype=sync.dtype
        )

    def init_info(self) -> dict[str, Any]:
        """What every server gets: the world size plays no part (colocated workers map the same buffers)."""
        if self.engine == "vllm":
            return {"packed": True}  # vLLM's IPCWeightTransferInitInfo has no other field
        return {
            "backend": "ipc",
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_size_bytes,
            "timeout_s": self.timeout_s,
        }

    def create_sender(self, inference_world_size: int) -> CudaIpcSender:
        return CudaIpcSender(inference_world_size, self)


def ipc_update_info(
    specs: list[TensorSpec], handles: dict[str, Any], policy_version: int | None
) -> dict[str, Any]:
    """The ``update_info`` of one packed bucket: vLLM's packed IPC fields, plus ``policy_version`` unless None
    (vLLM rejects it)."""
    info = {
        **specs_to_info(specs),
        "tensor_sizes": [spec.nbytes for spec in specs],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    }
    if policy_version is not None:
        info["policy_version"] = policy_version
    return info


class CudaIpcSender(WeightSender):
    """Control half of ``cuda_ipc``: per bucket, the trainer packs and exports a handle (keeping the buffer
    alive) and the servers map and copy it, before the trainer packs the next."""

    label = "CUDA IPC"
    how = "by CUDA IPC"

    def __init__(self, inference_world_size: int, strategy: CudaIpcStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.init_info = strategy.init_info()
        self.transfer_id = new_transfer_id()
        self.transport = CudaIpcTransport(
            transfer_id=self.transfer_id,
            bucket_size_bytes=strategy.bucket_size_bytes,
            stamp_version=strategy.engine == "torch",
            dtype=strategy.dtype,
        )

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await open_transport(
            self, source, TransportCall(self.transport, "open", {"release": list(release)}), self.timeout_s
        )
        await init_servers(self, control, "CUDA IPC", self.timeout_s)

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        await control.start_weight_update()
        bucket = await source.run(TransportCall(self.transport, "push", {"policy_version": policy_version}))
        while bucket is not None:
            await control.update_weights(bucket)
            # Only now may the trainer free the buffer: the servers have copied out of it.
            bucket = await source.run(TransportCall(self.transport, "next"))
        await control.finish_weight_update(policy_version)


@dataclass(frozen=True)
class CudaIpcTransport:
    """Transport half of ``cuda_ipc`` (picklable). ``push`` starts a pass over the weights and returns the
    first bucket's ``update_info``; each ``next`` frees the previous bucket's buffer and returns the next one's,
    or None at the end. Every rank walks the same buckets (joining each gather); rank 0 packs and exports."""

    transfer_id: str
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    stamp_version: bool = True
    dtype: str = "auto"

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> None:
        from rollflow.weights.trainer.sessions import open_session, release_sessions

        release_sessions(release)
        if not torch.cuda.is_available():
            raise WeightTransferError(
                "the cuda_ipc weight transfer needs CUDA; use 'broadcast' or 'checkpoint'"
            )
        open_session(self.transfer_id, rank, _IpcSession)

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> Any:
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        session = get_session(self.transfer_id, rank)
        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        session.start(
            _buckets(weights, self.bucket_size_bytes), policy_version if self.stamp_version else None
        )
        return session.next(rank)

    def next(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> Any:
        from rollflow.weights.trainer.sessions import get_session

        return get_session(self.transfer_id, rank).next(rank)

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])


def _buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive weights, cut as ``plan_buckets`` cuts them."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_size_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class _IpcSession:
    """One rank's pass over the buckets, and rank 0's buffer of the bucket the servers are reading."""

    def __init__(self) -> None:
        self._buckets: Iterator[list[tuple[str, torch.Tensor]]] = iter(())
        self._version: int | None = None
        self._buffer: torch.Tensor | None = None

    def start(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], policy_version: int | None) -> None:
        self._buckets, self._version, self._buffer = buckets, policy_version, None

    def next(self, rank: int) -> dict[str, Any] | None:
        from torch.multiprocessing.reductions import reduce_tensor

        self._buffer = None  # the servers copied the previous bucket out
        bucket = next(self._buckets, None)
        if bucket is None:
            if rank == 0:
                torch.cuda.ipc_collect()
            return None
        if rank != 0:
            return None
        device = torch.device("cuda", torch.cuda.current_device())
        self._buffer = pack([tensor for _, tensor in bucket], device)
        torch.cuda.synchronize(device)  # the receiver reads on another process's stream
        handles = {_gpu_uuid(device): reduce_tensor(self._buffer)}
        return ipc_update_info(specs_of(bucket), handles, self._version)

    def close(self) -> None:
        self._buffer = None
        self._buckets = iter(())


class CudaIpcReceiver:
    """Engine side of ``cuda_ipc``: maps the trainer's buffer and copies the tensors out."""

    def __init__(self, init_info: dict[str, Any]):
        if not torch.cuda.is_available():
            raise WeightTransferError("init_info.backend 'ipc' needs CUDA on the engine server")
        self.device = torch.device("cuda", torch.cuda.current_device())

    def receive(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Map the buffer of this GPU's UUID and return copies of its tensors.

        Raises:
            InvalidTransferInfoError: missing or malformed handles, or none for this GPU.
        """
        specs = specs_from_info(update_info)
        encoded = update_info.get("ipc_handles_pickled")
        if not isinstance(encoded, str):
            raise InvalidTransferInfoError("an ipc update_info needs 'ipc_handles_pickled' (base64 string)")
        try:
            handles = _TorchOnlyUnpickler(io.BytesIO(base64.b64decode(encoded))).load()
        except Exception as exc:
            raise InvalidTransferInfoError(
                f"update_info.ipc_handles_pickled cannot be decoded: {exc}"
            ) from exc
        uuid = _gpu_uuid(self.device)
        if uuid not in handles:
            raise InvalidTransferInfoError(
                f"no IPC handle for this engine's GPU {uuid} (got {', '.join(handles)}): cuda_ipc needs the "
                "trainer and the engine on the same GPU"
            )
        rebuild, args = handles[uuid]
        args = list(args)
        args[6] = self.device.index  # the sender's device index may differ under another CUDA_VISIBLE_DEVICES
        buffer = rebuild(*args)
        received = [(name, tensor.clone()) for name, tensor in unpack(buffer, specs)]
        torch.cuda.synchronize(self.device)
        return received

    def close(self) -> None:
        """Nothing to release."""
