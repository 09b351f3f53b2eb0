"""``env.kind = "openenv"``: the echo environment of openenv-core (made by its own ``openenv init``) served
by uvicorn, started by rollflow (``env.server``) or at a URL (``env.url``), driven by whole training runs of
the tiny model. Killing the server mid-run is counted as failures (masked samples), never as zero rewards,
and the failure limit stops the run with an error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import EnvFailureRateError
from tests.helpers.imports import needs
from tests.helpers.waits import wait_until

pytestmark = needs("openenv.core", "pip install 'rollflow[envs]'")

ECHO_APP = "echo_env.server.app:app"


@pytest.fixture(scope="module")
def echo_env_dir(tmp_path_factory) -> Path:
    """An echo environment as openenv-core's ``openenv init echo_env`` makes it."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(root)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (root / "echo_env" / "server" / "app.py").exists()
    return root


def config_for(tmp_path: Path, *overrides: str):
    return load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=openenv",
            "env.kind='openenv'",
            "env.id='echo'",
            "env.observation_key='echoed_message'",
            "env.max_seq_len=64",
            "env.num_tasks=8",
            "env.max_concurrent=1",  # the echo server of openenv init serves one session at a time
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            "orchestrator.prompts_per_step=2",
            "checkpoint.every=0",
            "inference.router_port=0",
            *overrides,
        ],
    )


def read_metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "runs" / "openenv" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
async def test_twenty_steps_on_a_server_rollflow_starts(tmp_path, echo_env_dir):
    config = config_for(
        tmp_path, f"env.server='{ECHO_APP}'", f"env.server_dir='{echo_env_dir}'", "orchestrator.steps=20"
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    assert len(metrics) == 20
    assert sum(m["env_errors"] + m["env_timeouts"] for m in metrics) == 0
    assert sum(m["env_trajectories"] for m in metrics) == 20 * 2 * 2
    # The echo environment's reward: a tenth of the echoed reply's length, so positive for any reply.
    assert all(m["reward_mean"] > 0 for m in metrics)
    assert all(m["reward/openenv"] == pytest.approx(m["reward_mean"]) for m in metrics)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
async def test_killed_server_is_counted_as_failures_and_the_limit_stops_the_run(tmp_path, echo_env_dir):
    import httpx

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", ECHO_APP, "--app-dir", str(echo_env_dir), "--port", str(port)],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        await wait_until(healthy, "the echo server answers /health", timeout_s=60)
        config = config_for(
            tmp_path,
            f"env.url='http://127.0.0.1:{port}'",
            "orchestrator.steps=20",
            "env.on_failure='refill'",
            "env.max_retries=1",
            "env.failure_window=12",
            "env.max_failure_rate=0.5",
        )
        async with Orchestrator(config) as orchestrator:
            before = await orchestrator.run(steps=2)
            server.kill()
            server.wait(timeout=30)
            with pytest.raises(EnvFailureRateError) as error:
                await orchestrator.run()
    finally:
        server.kill()
        server.wait(timeout=30)
    assert sum(m["env_errors"] for m in before) == 0
    message = str(error.value)
    assert "env.max_failure_rate = 0.5" in message and "errors" in message
    # Steps trained after the kill (before the limit) counted failures and trained none of them at 0.
    after = read_metrics(tmp_path)[len(before) :]
    for step in after:
        assert step["env_errors"] > 0 and step["num_masked_samples"] > 0


async def test_eval_runs_the_seeds_after_the_training_ones_in_a_run_and_offline(tmp_path, echo_env_dir):
    from rollflow.orchestrator.offline import evaluate_offline

    config = config_for(
        tmp_path,
        f"env.server='{ECHO_APP}'",
        f"env.server_dir='{echo_env_dir}'",
        "orchestrator.steps=1",
        "eval.num_prompts=2",
        "eval.samples=2",
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
        task = orchestrator.evaluator.task
        assert [task.item(i).metadata["env_task"] for i in range(2)] == [8, 9]  # env.num_tasks = 8 train
    assert metrics[0]["env_trajectories"] == 4  # training only: evaluation's are not in the step's counts
    evals = [record for record in read_metrics(tmp_path) if "eval/greedy/reward_mean" in record]
    assert len(evals) == 2  # before training and after the step
    offline = await evaluate_offline(config)
    for record in [*evals, offline]:
        assert record["eval/env_errors"] == record["eval/env_timeouts"] == 0
        # The echo environment's reward is a tenth of the reply's length (stripped): the tiny model's greedy
        # reply is whitespace (0), its sampled ones are not.
        assert record["eval/greedy/reward_mean"] >= 0 and record["eval/sampled/reward_mean"] > 0
        assert record["eval/sampled/pass@1"] <= record["eval/sampled/pass@2"]
    assert offline["eval/num_prompts"] == 2
