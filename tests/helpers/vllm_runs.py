"""``rollflow run`` of the quickstart task against vLLM (a subprocess, as a user runs it), and what its metrics
must show: every step drawn with the weights just pushed (sync mode), each push's proof of delivery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .vllm_server import MODULE_ENTRY_POINT

# sync mode: every sample is drawn with the weights the trainer held, so only kernel sums differ.
MISMATCH_BOUND = 1e-4
# The transports into vLLM: weight_sync overrides of each.
TRANSPORTS: dict[str, dict[str, str]] = {
    "checkpoint": {"weight_sync.strategy": "'checkpoint'"},
    "gloo": {"weight_sync.strategy": "'broadcast'", "weight_sync.backend": "'gloo'"},
}


def managed_vllm(python: str) -> dict[str, str]:
    """Overrides of a run on one vLLM server it starts from ``python``'s environment (float32, tiny-h32)."""
    return {
        "model.path": "'rollflow:tiny-h32'",
        "inference.mode": "'http'",
        "inference.engine": "'vllm'",
        "inference.num_servers": "1",
        "inference.dtype": "'float32'",
        "inference.vllm_command": json.dumps([python, *MODULE_ENTRY_POINT]),
        "inference.router_port": "0",
    }


def run_quickstart(
    cwd: Path, overrides: dict[str, str], *, timeout_s: float, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``examples/quickstart.toml`` with ``overrides`` (``--set KEY=VALUE``) in ``cwd``; its metrics, one
    dict per step. Fails the test (with the run's stderr) if the run fails."""
    from ..conftest import REPO_ROOT

    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    quickstart = str(REPO_ROOT / "examples" / "quickstart.toml")
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", "run", quickstart, "--no-progress", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (cwd / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def check_vllm_steps(metrics: list[dict[str, Any]], steps: int) -> None:
    """Every step trained on samples from the weights just pushed, and proved each push's delivery."""
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    mismatch = [m["logprob_mismatch"] for m in metrics]
    assert all(value < MISMATCH_BOUND for value in mismatch), mismatch
    # The senders into vLLM check the served version and digests after every push, and time it.
    assert all(m["delivery_check_time_s"] > 0 for m in metrics), [
        m.get("delivery_check_time_s") for m in metrics
    ]
    assert all(m["weight_transfer_time_s"] > 0 for m in metrics)
