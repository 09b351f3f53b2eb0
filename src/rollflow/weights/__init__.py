"""Weight transfer from the trainer into inference engines: ``local``, ``broadcast``, ``checkpoint``, ``cuda_ipc``.

``rollflow.weights.base`` holds the interface (and imports no torch); each strategy lives in its own module as a
control half (HTTP to the servers, in the orchestrator) and a transport half (a picklable spec run where the
weights are: the trainer thread, the trainer process, each trainer rank), and
``rollflow.weights.receiver.create_receiver`` is the engine server's side. Typical use from the orchestrator::

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
