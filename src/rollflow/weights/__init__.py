"""Weight transfer from the trainer into inference engines: ``local``, ``broadcast``, ``checkpoint``, ``cuda_ipc``,
and ``vllm_lora`` (a LoRA run's adapter into vLLM's LoRA API; the barrier picks it).

``rollflow.weights.base`` holds the interface. The package is split by the process each part runs in:

- ``weights/<strategy>.py`` (``local``, ``broadcast``, ``vllm_nccl``, ``checkpoint``, ``cuda_ipc``,
  ``vllm_lora``) and
  ``base``, ``registry``, ``ranks``, ``rounds``: the orchestrator's side, importing no torch: each strategy,
  its control half (HTTP to the servers) and its transport half as a picklable spec;
- ``weights/trainer/``: what those specs run on the trainer ranks (sessions, process groups, files, IPC
  buffers);
- ``weights/server/``: the engine server's side, the receivers (``create_receiver``);
- ``groups`` and ``packing``: the torch pieces the trainer and server sides share.

Typical use from the orchestrator::

    transfer = WeightTransfer(create_strategy("broadcast", bucket_size_mb=256, timeout_s=300))
    # Engines paused around this; the first push connects (asks client.get_world_size(), opens the transport
    # on the trainer, sends init_info), and a push after a failure reconnects. ``trainer`` is any handle with
    # ``push_weights(call)`` (``Trainer``, ``TrainerProcess``, ``StaticWeights``).
    await transfer.push(client, trainer, policy_version)
    transfer.close()
"""

from rollflow.errors import InvalidTransferInfoError, WeightTransferError, WeightTransferTimeoutError
from rollflow.weights.base import (
    STRATEGIES,
    TRANSFER_DTYPES,
    StaticWeights,
    TransportCall,
    WeightPusher,
    WeightSender,
    WeightSource,
    WeightTransfer,
    WeightTransferStrategy,
    connect_sender,
)
from rollflow.weights.ranks import init_info_for_servers, per_server_init_infos
from rollflow.weights.registry import create_strategy, register_strategy, strategy_from_config

__all__ = [
    "STRATEGIES",
    "TRANSFER_DTYPES",
    "InvalidTransferInfoError",
    "StaticWeights",
    "TransportCall",
    "WeightPusher",
    "WeightSender",
    "WeightSource",
    "WeightTransfer",
    "WeightTransferError",
    "WeightTransferStrategy",
    "WeightTransferTimeoutError",
    "connect_sender",
    "create_strategy",
    "init_info_for_servers",
    "per_server_init_infos",
    "register_strategy",
    "strategy_from_config",
]
