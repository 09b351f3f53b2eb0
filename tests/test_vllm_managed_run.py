"""``rollflow run`` with vLLM servers rollflow starts itself (``inference.engine = "vllm"``, started through
``inference.vllm_command`` from the vLLM environment), fed by the checkpoint strategy through rollflow's plugin
engine. Its own server start (minutes on a CPU), so ``slow``: ``nox -s tests_vllm`` runs it, CI's vLLM pass
does not (``-m "vllm and not slow"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT
from .helpers.vllm_server import MODULE_ENTRY_POINT, PYTHON_ENV, SERVER_ENV, SKIP_REASON

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_run_starts_its_vllm_server_and_pushes_each_step_into_it(tmp_path) -> None:
    python = os.environ.get(PYTHON_ENV)
    if not python:  # ROLLFLOW_VLLM_URL alone names a running server; this test starts its own
        pytest.skip(SKIP_REASON)
    steps = 3
    overrides = {
        "model.path": "'rollflow:tiny-h32'",
        "inference.mode": "'http'",
        "inference.engine": "'vllm'",
        "inference.num_servers": "1",
        "inference.dtype": "'float32'",
        "inference.vllm_command": json.dumps([python, *MODULE_ENTRY_POINT]),
        "inference.router_port": "0",
        "weight_sync.strategy": "'checkpoint'",
        "orchestrator.steps": str(steps),
        "orchestrator.prompts_per_step": "4",
        "checkpoint.every": "0",
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    quickstart = str(REPO_ROOT / "examples" / "quickstart.toml")
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", "run", quickstart, "--no-progress", *args],
        cwd=tmp_path,
        env={**os.environ, **SERVER_ENV},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    mismatch = [m["logprob_mismatch"] for m in metrics]
    assert all(value < 1e-4 for value in mismatch), mismatch  # sync: drawn with the weights just pushed
    logs = list((tmp_path / "runs" / "quickstart").rglob("server-0.log"))
    assert logs and "RollflowEngine" in logs[0].read_text()  # the plugin engine received them
