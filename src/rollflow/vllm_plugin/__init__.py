"""rollflow's vLLM plugin: weight-transfer engines that a CPU can run, for vLLM's own RL control plane.

vLLM calls ``register`` in each of its processes at start-up (entry point group ``vllm.general_plugins`` in
rollflow's ``pyproject.toml``); a server started with ``--weight-transfer-config '{"backend":
"rollflow_checkpoint"}'`` then receives weights through ``RollflowCheckpointEngine``
(``rollflow.vllm_plugin.checkpoint_engine``), driven by vLLM's routes ``/init_weight_transfer_engine`` ▸
``/start_weight_update`` ▸ ``/update_weights`` ▸ ``/finish_weight_update``.

This package runs inside vLLM's environment, which need not have rollflow's dependencies (rollflow is
installed there with ``--no-deps``): it imports only the standard library, torch, safetensors and vllm, and
nothing else of rollflow. Importing this module imports none of them; ``register`` imports vllm.
"""

from __future__ import annotations

#: The ``backend`` of ``--weight-transfer-config`` that selects the checkpoint-files engine.
CHECKPOINT_BACKEND = "rollflow_checkpoint"

__all__ = ["CHECKPOINT_BACKEND", "register"]


def register() -> None:
    """Register rollflow's weight-transfer engines with vLLM (idempotent: vLLM may call it more than once in
    one process, and its registry refuses a name twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if CHECKPOINT_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            CHECKPOINT_BACKEND, "rollflow.vllm_plugin.checkpoint_engine", "RollflowCheckpointEngine"
        )
