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

This module imports no torch: packing and exporting run on the trainer ranks (``weights.trainer.cuda_ipc``),
mapping in the servers (``weights.server.cuda_ipc``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollflow.errors import WeightTransferError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    new_transfer_id,
)
from rollflow.weights.payloads import DEFAULT_IPC_BUCKET_SIZE_BYTES, IpcInit
from rollflow.weights.rounds import init_servers, open_transport

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

DEFAULT_BUCKET_SIZE_BYTES = DEFAULT_IPC_BUCKET_SIZE_BYTES


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
        self.engine = engine
        self.bucket_size_bytes = max(1, int(bucket_size_mb * 2**20))
        self.timeout_s = timeout_s
        self.dtype = check_transfer_dtype(dtype)

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        return dict(
            bucket_size_mb=sync.bucket_size_mb, timeout_s=sync.timeout_s, engine=engine, dtype=sync.dtype
        )

    def init_info(self) -> dict[str, Any]:
        """What every server gets: the world size plays no part (colocated workers map the same buffers)."""
        payload = IpcInit(packed_buffer_size_bytes=self.bucket_size_bytes, timeout_s=self.timeout_s)
        # vLLM's IPCWeightTransferInitInfo has no other field than {"packed": true}.
        return payload.encode_for(self.engine)  # type: ignore[arg-type]

    def create_sender(self, inference_world_size: int) -> CudaIpcSender:
        return CudaIpcSender(inference_world_size, self)


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
        import torch

        from rollflow.weights.trainer.cuda_ipc import IpcSession
        from rollflow.weights.trainer.sessions import open_session, release_sessions

        release_sessions(release)
        if not torch.cuda.is_available():
            raise WeightTransferError(
                "the cuda_ipc weight transfer needs CUDA; use 'broadcast' or 'checkpoint'"
            )
        open_session(self.transfer_id, rank, IpcSession)

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> Any:
        from rollflow.weights.trainer.cuda_ipc import buckets
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        session = get_session(self.transfer_id, rank)
        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        session.start(
            buckets(weights, self.bucket_size_bytes), policy_version if self.stamp_version else None
        )
        return session.next(rank)

    def next(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> Any:
        from rollflow.weights.trainer.sessions import get_session

        return get_session(self.transfer_id, rank).next(rank)

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])
