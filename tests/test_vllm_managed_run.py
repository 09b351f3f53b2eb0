"""``rollflow run`` with vLLM servers rollflow starts itself (``inference.engine = "vllm"``, started through
``inference.vllm_command`` from the vLLM environment), fed every step through rollflow's plugin engine by each
transport a CPU has: checkpoint files and a gloo broadcast. Every step is drawn with the weights just pushed
(sync: mismatch < 1e-4) and proves its delivery. A server start each (minutes on a CPU), so ``slow``:
``nox -s tests_vllm`` runs them, CI's vLLM pass does not (``-m "vllm and not slow"``).
``ROLLFLOW_VLLM_TRAIN_STEPS`` lengthens the runs (the reward curve is printed)."""

from __future__ import annotations

import json
import os

import pytest

from .helpers.vllm_runs import TRANSPORTS, check_vllm_steps, run_quickstart
from .helpers.vllm_server import MODULE_ENTRY_POINT, PYTHON_ENV, SERVER_ENV, SKIP_REASON

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_run_starts_its_vllm_server_and_pushes_each_step_into_it(transport: str, tmp_path) -> None:
    python = os.environ.get(PYTHON_ENV)
    if not python:  # ROLLFLOW_VLLM_URL alone names a running server; this test starts its own
        pytest.skip(SKIP_REASON)
    steps = int(os.environ.get("ROLLFLOW_VLLM_TRAIN_STEPS", "3"))
    overrides = {
        "model.path": "'rollflow:tiny-h32'",
        "inference.mode": "'http'",
        "inference.engine": "'vllm'",
        "inference.num_servers": "1",
        "inference.dtype": "'float32'",
        "inference.vllm_command": json.dumps([python, *MODULE_ENTRY_POINT]),
        "inference.router_port": "0",
        **TRANSPORTS[transport],
        "orchestrator.steps": str(steps),
        "orchestrator.prompts_per_step": "4",
        "checkpoint.every": "0",
    }
    metrics = run_quickstart(tmp_path, overrides, timeout_s=3500, env=SERVER_ENV)
    check_vllm_steps(metrics, steps)
    logs = list((tmp_path / "runs" / "quickstart").rglob("server-0.log"))
    assert logs and "RollflowEngine" in logs[0].read_text()  # the plugin engine received them
    rewards = [round(m["reward_mean"], 3) for m in metrics]
    print(f"{transport}: {steps} steps, reward first 5 {rewards[:5]}, last 10 {rewards[-10:]}")
