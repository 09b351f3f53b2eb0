"""The engine server's half of ``cuda_ipc``: map the trainer's buffer by its IPC handle (imports torch)."""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from rollflow.errors import InvalidTransferInfoError, WeightTransferError
from rollflow.weights.packing import gpu_uuid, specs_from_info, unpack
from rollflow.weights.payloads import IpcInit, IpcUpdate, decode_update_info


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Resolves only names from torch modules: enough for ``reduce_tensor``'s output, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from an IPC handle")


class CudaIpcReceiver:
    """Engine side of ``cuda_ipc``: maps the trainer's buffer and copies the tensors out."""

    def __init__(self, init_info: IpcInit):
        if not torch.cuda.is_available():
            raise WeightTransferError("init_info.backend 'ipc' needs CUDA on the engine server")
        self.device = torch.device("cuda", torch.cuda.current_device())

    def receive(self, update_info: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Map the buffer of this GPU's UUID and return copies of its tensors.

        Raises:
            InvalidTransferInfoError: missing or malformed handles, or none for this GPU.
        """
        update = decode_update_info(update_info, IpcUpdate)
        specs = specs_from_info(update)
        encoded = update.ipc_handles_pickled
        if not isinstance(encoded, str):
            raise InvalidTransferInfoError("an ipc update_info needs 'ipc_handles_pickled' (base64 string)")
        try:
            handles = _TorchOnlyUnpickler(io.BytesIO(base64.b64decode(encoded))).load()
        except Exception as exc:
            raise InvalidTransferInfoError(
                f"update_info.ipc_handles_pickled cannot be decoded: {exc}"
            ) from exc
        uuid = gpu_uuid(self.device)
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
