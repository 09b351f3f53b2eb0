"""Weight transfer from the trainer into inference engines: ``local``, ``broadcast``, ``checkpoint``, ``cuda_ipc``.

``rollflow.weights.base`` holds the interface (and imports no torch); each strategy lives in its own module,
and ``rollflow.weights.receiver.create_receiver`` is the engine server's side. Typical trainer-side use::

    transfer = WeightTransfer(create_strategy("broadcast", bucket_size_mb=256, timeout_s=300))
    # Engines paused around this; the first push connects (asks client.get_world_size(), sends init_info),
    # and a push after a failure reconnects.
    await transfer.push(client, model.state_dict().items(), policy_version)
    transfer.close()
"""

from rollflow.weights.base import (
    STRATEGIES,
    InvalidTransferInfoError,
    WeightSender,
    WeightTransfer,
    WeightTransferError,
    WeightTransferStrategy,
    WeightTransferTimeoutError,
    connect_sender,
    create_strategy,
    init_info_for_servers,
    server_init_infos,
)

__all__ = [
    "STRATEGIES",
    "InvalidTransferInfoError",
    "WeightSender",
    "WeightTransfer",
    "WeightTransferError",
    "WeightTransferStrategy",
    "WeightTransferTimeoutError",
    "connect_sender",
    "create_strategy",
    "init_info_for_servers",
    "server_init_infos",
]
