"""``cuda_ipc``: trainer and engine share a GPU; the engine maps the trainer's packed buffers by CUDA IPC handle.

Per bucket the sender packs tensors into one CUDA ``uint8`` buffer, exports its IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``) keyed by the GPU's UUID, and sends it in one
``/update_weights`` call (vLLM's ``ipc_handles_pickled`` and ``tensor_sizes``). The buffer stays alive until
that call returned, and the receiver copies out of it before returning, so the trainer may then free it.

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
from collections.abc import Iterable
from typing import Any

import anyio
import torch

from rollflow.weights.base import (
    InvalidTransferInfoError,
    WeightSender,
    WeightTransferError,
    WeightTransferStrategy,
    WeightTransferTimeoutError,
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
    """

    name = "cuda_ipc"

    def __init__(
        self,
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_BYTES / 2**20,
        timeout_s: float = 300.0,
        engine: str = "torch",
    ):
        if bucket_size_mb <= 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be positive, got {bucket_size_mb}")
        if engine not in ("torch", "vllm"):
            raise ValueError(f"cuda_ipc engine must be 'torch' or 'vllm', got {engine!r}")
        self.bucket_size_bytes = max(1, int(bucket_size_mb * 2**20))
        self.timeout_s = timeout_s
        self.engine = engine

    def create_init_info(self, inference_world_size: int) -> dict[str, Any]:
        # Every colocated worker maps the same buffers, so the world size plays no part.
        if self.engine == "vllm":
            return {"packed": True}  # vLLM's IPCWeightTransferInitInfo has no other field
        return {
            "backend": "ipc",
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_size_bytes,
            "timeout_s": self.timeout_s,
        }

    def create_sender(self, init_info: dict[str, Any]) -> CudaIpcSender:
        return CudaIpcSender(
            init_info,
            bucket_size_bytes=self.bucket_size_bytes,
            timeout_s=self.timeout_s,
            stamp_version=self.engine == "torch",
        )


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
    """Trainer side of ``cuda_ipc``.

    Args:
        init_info: from ``CudaIpcStrategy.create_init_info``.
        bucket_size_bytes: size of each packed buffer.
        timeout_s: longest one push may take.
        stamp_version: put ``policy_version`` in each ``update_info`` (rollflow servers; vLLM rejects it).
    """

    def __init__(
        self,
        init_info: dict[str, Any],
        *,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        timeout_s: float = 300.0,
        stamp_version: bool = True,
    ):
        super().__init__(init_info)
        self.bucket_size_bytes = bucket_size_bytes
        self.timeout_s = timeout_s
        self.stamp_version = stamp_version

    async def setup(self, client: Any) -> None:
        if not torch.cuda.is_available():
            raise WeightTransferError(
                "the cuda_ipc weight transfer needs CUDA; use 'broadcast' or 'checkpoint'"
            )
        with anyio.fail_after(self.timeout_s):
            await client.init_weight_update_communicator(self.init_info)

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.device("cuda", torch.cuda.current_device())
        tensors = [(name, torch.as_tensor(value).detach()) for name, value in named_weights]
        specs = specs_of(tensors)
        try:
            with anyio.fail_after(self.timeout_s):
                await client.start_weight_update()
                for bucket in plan_buckets(specs, self.bucket_size_bytes):
                    bucket_specs = [specs[i] for i in bucket]
                    buffer = pack([tensors[i][1] for i in bucket], device)
                    torch.cuda.synchronize(device)  # the receiver reads on another process's stream
                    handles = {_gpu_uuid(device): reduce_tensor(buffer)}
                    version = policy_version if self.stamp_version else None
                    await client.update_named_weights(ipc_update_info(bucket_specs, handles, version))
                    del buffer  # only now: the receiver has copied out of it
                await client.finish_weight_update(weight_version=policy_version)
        except TimeoutError as exc:
            raise WeightTransferTimeoutError(
                f"pushing policy version {policy_version} by CUDA IPC took longer than {self.timeout_s:g} s"
            ) from exc
        finally:
            torch.cuda.ipc_collect()


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
