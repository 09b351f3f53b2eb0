"""GPU assignment of the servers rollflow starts on this machine (no Ray): one GPU, or one tensor-parallel
group of GPUs, per server, through each server's ``CUDA_VISIBLE_DEVICES``.

Server ``i`` gets devices ``[i * tp, (i + 1) * tp)`` of the devices this process sees (its own
``CUDA_VISIBLE_DEVICES`` when set, so a run confined to GPUs ``4,5,6,7`` hands those out). The trainer uses
``cuda:0`` (its rank ``r``: ``cuda:r``) of the same devices, so with ``inference.colocate`` server 0 shares
the trainer's GPU; without it, servers and trainer ranks on the same GPU share its memory.

Pure apart from ``visible_cuda_devices`` (which asks torch how many GPUs there are); no torch import at
module scope.
"""

from __future__ import annotations

import os

from rollflow.errors import ConfigError


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries: that variable's list
    when set, else ``0 .. n-1`` for the GPUs torch sees (none on a machine without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [device.strip() for device in listed.split(",") if device.strip() and device.strip() != "-1"]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def server_gpu_env(num_servers: int, tensor_parallel_size: int, devices: list[str]) -> list[dict[str, str]]:
    """Each server's ``{"CUDA_VISIBLE_DEVICES": …}``: server ``i`` gets ``devices[i * tp:(i + 1) * tp]``.

    Raises:
        ConfigError: fewer devices than ``num_servers * tensor_parallel_size`` (the message names the keys).
    """
    needed = num_servers * tensor_parallel_size
    if len(devices) < needed:
        raise ConfigError(
            f"inference.num_servers = {num_servers} × inference.tensor_parallel_size = {tensor_parallel_size} "
            f"needs {needed} GPUs, but this machine has {len(devices)} (CUDA devices {','.join(devices) or 'none'}"
            "); lower inference.num_servers or inference.tensor_parallel_size, or run on more GPUs"
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tensor_parallel_size : (i + 1) * tensor_parallel_size])}
        for i in range(num_servers)
    ]
