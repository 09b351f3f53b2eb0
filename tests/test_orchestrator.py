"""The orchestrator end to end on the real tiny model: embedded use, policy versions, reward failures,
run-directory rules and resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rollflow import Orchestrator
from rollflow.errors import CheckpointError, ConfigError
from rollflow.rollout.tasks import TaskItem

from .helpers.runs import read_jsonl, small_config


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_start_run_stop_in_a_running_loop(tmp_path):
    config = small_config(tmp_path, "orchestrator.steps=3")
    orchestrator = await Orchestrator.start(config)
    try:
        first = await orchestrator.run(steps=2)
        rest = await orchestrator.run()  # up to orchestrator.steps in total
    finally:
        await orchestrator.stop()
    assert [m["step"] for m in first + rest] == [1, 2, 3]
    assert orchestrator.state.policy_version == 3
    assert orchestrator.state.data_position == 3 * 4
    run_dir = config.run_dir
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["name"] == "t"
    assert saved["model"]["renderer"] == "qwen3"  # `auto`, as resolved for rollflow:tiny
    for metrics in first + rest:
        assert metrics["num_samples"] == 16
        assert metrics["logprob_mismatch"] < 1e-4
        for key in ("loss", "grad_norm", "entropy", "clip_fraction", "tokens_per_s", "reward_mean"):
            assert key in metrics, key


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_every_sample_records_the_policy_version_it_was_sampled_with(tmp_path):
    config = small_config(tmp_path, "orchestrator.steps=3")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run()
    rollouts = read_jsonl(config.run_dir / "rollouts.jsonl")
    assert len(rollouts) == 3 * 4
    # Sync schedule: step t trains on samples of policy version t - 1, never older, never newer.
    assert all(record["min_policy_version"] == record["step"] - 1 for record in rollouts)
    assert sorted(record["prompt_index"] for record in rollouts) == list(range(12))


calls = {"n": 0}


def flaky_reward(completion: str, item: TaskItem) -> float:
    calls["n"] += 1
    if calls["n"] % 3 == 0:
        raise ValueError("judge unavailable")
    return 1.0 if any(char.isdigit() for char in completion) else 0.0


async def test_a_raising_reward_masks_samples_and_the_run_goes_on(tmp_path):
    config = small_config(
        tmp_path, "orchestrator.steps=2", "data.reward='tests.test_orchestrator:flaky_reward'"
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    assert len(metrics) == 2
    assert all(m["reward_errors"] > 0 for m in metrics)
    assert all(m["num_masked_samples"] == m["reward_errors"] for m in metrics)


async def test_existing_run_directory_needs_resume(tmp_path):
    config = small_config(tmp_path, "orchestrator.steps=1")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run()
    with pytest.raises(ConfigError, match="--resume"):
        await Orchestrator.start(config)


async def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        await Orchestrator.start(small_config(tmp_path), resume=True)


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    config = small_config(tmp_path, "orchestrator.steps=4", "checkpoint.every=2")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=3)  # checkpoint at step 2; step 3 is lost with the "crash"
        weights_at_3 = {name: tensor.clone() for name, tensor in orchestrator.trainer.named_weights()}
    async with Orchestrator(config, resume=True) as orchestrator:
        assert orchestrator.state.step == 2
        assert orchestrator.state.data_position == 2 * 4
        await orchestrator.run()
        weights_at_4 = dict(orchestrator.trainer.named_weights())
    assert [m["step"] for m in read_jsonl(config.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    prompts = [r["prompt_index"] for r in read_jsonl(config.run_dir / "rollouts.jsonl")]
    assert sorted(prompts) == list(range(16))
    assert any((weights_at_3[name] != tensor).any() for name, tensor in weights_at_4.items())


def server_children(command: bytes = b"serve") -> list[int]:
    """Pids of this process's children that run ``rollflow serve`` (or another rollflow ``command``)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and command in argv:
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
@pytest.mark.http_only(reason="a server killed under a run")
async def test_a_server_dying_mid_run_does_not_stop_the_run(tmp_path, monkeypatch):
    """http mode, 2 servers: kill one; the router and the weight transfer carry on with the other."""
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    config = small_config(
        tmp_path,
        "inference.mode='http'",
        "inference.router_port=0",
        "inference.health_check_interval_s=0.5",
        "orchestrator.steps=5",
    )
    # Servers of the suite's shared fixtures may be running too: only those this run starts count.
    before = set(server_children()), set(server_children(b"router"))
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=2)
        servers = sorted(set(server_children()) - before[0])
        assert len(servers) == 2
        os.kill(servers[0], signal.SIGKILL)
        metrics = await orchestrator.run()
    assert [m["step"] for m in metrics] == [3, 4, 5]
    assert orchestrator.state.policy_version == 5
    # Nothing left behind.
    assert set(server_children()) <= before[0] and set(server_children(b"router")) <= before[1]
