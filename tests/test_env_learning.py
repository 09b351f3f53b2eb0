"""The quickstart's case task as a verifiers environment (``examples/envs/verifiers_case.toml``: a
``vf.Taskset`` with a ``@vf.reward``, played through verifiers' episodes and rollflow's TITO sessions) learns
to the quickstart's bar on the tiny model."""

from __future__ import annotations

import statistics
import time

import pytest

from rollflow import Orchestrator, load_config

from .conftest import REPO_ROOT

pytest.importorskip("verifiers.v1", reason="needs pip install 'rollflow[envs]'")

STEPS = 150  # the quickstart passes 0.9 at about step 110


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_case_task_as_a_verifiers_environment_learns(tmp_path):
    config = load_config(
        [REPO_ROOT / "examples" / "envs" / "verifiers_case.toml"],
        [f"output_dir='{tmp_path}'", f"orchestrator.steps={STEPS}", "checkpoint.every=0"],
    )
    started = time.monotonic()
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    rewards = [m["reward_mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])
    print(f"verifiers case env: {time.monotonic() - started:.0f} s, first 5 {first:.3f}, last 10 {last:.3f}")
    assert len(rewards) == STEPS
    # A failed trajectory is refilled, never trained as a zero. Intermittent connection errors between the
    # in-process harness and verifiers' interception server were seen on a loaded machine (8 and 24 of 19,200
    # trajectories in two runs), refilled by env.on_failure; their cause is not found yet.
    failed = sum(m["env_errors"] + m["env_timeouts"] for m in metrics)
    assert failed <= 0.005 * sum(m["env_trajectories"] for m in metrics)
    assert sum(m["num_masked_samples"] for m in metrics) == 0
    assert all(m["reward/case"] == pytest.approx(m["reward_mean"]) for m in metrics)
    assert first <= 0.6
    assert last >= 0.9
