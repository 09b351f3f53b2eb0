"""Failures are not rewards: ``EnvGenerator`` over a real ``TITOProxy`` and the tiny model, with an
environment written here (an ``EnvSource`` whose trajectories call the model with the openai SDK, then
finish, raise, hang, report their own timeout or lose their server, as the task's metadata says)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from rollflow.errors import ConfigError, EnvFailureRateError
from rollflow.messages import RolloutRequest
from rollflow.rollout.envs import EnvGenerator, EnvOutcome, FailureRate
from rollflow.tito import TITOProxy
from tests.helpers.tito import MODEL


class ScriptedEnv:
    """Each trajectory asks the model once, then does what ``behaviours[(prompt, sample, attempt)]`` (default
    ``ok``) says: ``ok`` (reward 1, part ``done``), ``raise``, ``hang``, ``own_timeout``, ``lost_server``
    (a request to a port nothing listens on)."""

    def __init__(self, behaviours: dict[tuple[int, int, int], str] | None = None):
        self.behaviours = behaviours or {}
        self.attempts: dict[tuple[int, int], int] = {}
        self.task = None

    async def rollout(self, base_url, task):
        key = (task.prompt_index, task.sample_index)
        attempt = self.attempts.get(key, 0)
        self.attempts[key] = attempt + 1
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
        behaviour = self.behaviours.get((*key, attempt), "ok")
        if behaviour == "raise":
            raise RuntimeError("the environment broke")
        if behaviour == "hang":
            await asyncio.Event().wait()
        if behaviour == "own_timeout":
            return EnvOutcome(timed_out=True)
        if behaviour == "lost_server":
            async with httpx.AsyncClient() as http:
                await http.post(f"http://127.0.0.1:{free_port()}/step", json={})
        return EnvOutcome(reward=1.0, parts={"done": 1.0})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def proxy(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=4
    ) as p:
        yield p


def request(num_samples: int, prompt_index: int = 0) -> RolloutRequest:
    return RolloutRequest(
        prompt_index=prompt_index, messages=[{"role": "user", "content": "hi"}], num_samples=num_samples
    )


def generator(proxy, env, **rules) -> EnvGenerator:
    return EnvGenerator(proxy, env, max_seq_len=256, **rules)


async def test_raise_lost_server_and_timeouts_are_masked_and_counted(proxy):
    env = ScriptedEnv(
        {(0, 1, 0): "raise", (0, 2, 0): "lost_server", (0, 3, 0): "hang", (0, 4, 0): "own_timeout"}
    )
    group = await generator(proxy, env, on_failure="mask", timeout_s=5.0).generate_group(request(5))
    by_trajectory = {s.trajectory: s for s in group.samples}
    assert not by_trajectory[0].masked and by_trajectory[0].reward == 1.0
    assert [by_trajectory[t].mask_reason for t in (1, 2, 3, 4)] == [
        "env_error",
        "env_error",
        "env_timeout",
        "env_timeout",
    ]
    assert all(by_trajectory[t].reward == 0.0 for t in (1, 2, 3, 4))
    assert group.metrics["env_errors"] == 2 and group.metrics["env_timeouts"] == 2
    assert group.metrics["env_retries"] == 0 and group.metrics["env_dropped_groups"] == 0
    # Only the good trajectory's reward parts are logged.
    assert group.metrics["reward_sum/done"] == 1.0 and group.metrics["reward_count/done"] == 1.0


async def test_refill_retries_failed_trajectories_within_the_bound(proxy):
    env = ScriptedEnv({(0, 0, 0): "raise", (0, 1, 0): "raise", (0, 1, 1): "raise", (0, 1, 2): "raise"})
    group = await generator(proxy, env, on_failure="refill", max_retries=2).generate_group(request(2))
    by_trajectory = {s.trajectory: s for s in group.samples}
    assert not by_trajectory[0].masked and by_trajectory[0].reward == 1.0  # refilled on its second attempt
    assert by_trajectory[1].mask_reason == "env_error"  # failed all 1 + 2 attempts
    assert env.attempts == {(0, 0): 2, (0, 1): 3}
    assert group.metrics["env_errors"] == 4 and group.metrics["env_retries"] == 3


async def test_group_with_too_few_good_trajectories_is_dropped(proxy):
    env = ScriptedEnv({(0, 0, 0): "raise", (0, 1, 0): "raise"})
    rules = {"on_failure": "mask", "min_group_samples": 2}
    group = await generator(proxy, env, **rules).generate_group(request(3))
    assert all(s.masked for s in group.samples)
    assert {s.mask_reason for s in group.samples} == {"env_error", "env_group_dropped"}
    assert group.metrics["env_dropped_groups"] == 1
    assert "reward_sum/done" not in group.metrics


async def test_failure_rate_limit_stops_with_an_error_naming_the_causes(proxy):
    env = ScriptedEnv({(0, i, a): "raise" for i in range(4) for a in range(3)})
    rules = {"on_failure": "refill", "max_retries": 2, "max_failure_rate": 0.5, "failure_window": 4}
    with pytest.raises(EnvFailureRateError) as error:
        await generator(proxy, env, **rules).generate_group(request(4))
    message = str(error.value)
    assert "failed" in message and "errors" in message and "env.max_failure_rate = 0.5" in message
    assert "RuntimeError: the environment broke" in message
    # Bounded: it stopped once the window was full (attempts already in flight finish), not after every
    # retry of every trajectory (12).
    assert sum(env.attempts.values()) <= 4 + 4


def test_failure_rate_window():
    rate = FailureRate(0.5, 4)
    for cause in [None, "error", None, "error", None, "timeout"]:
        rate.record(cause)  # never more than half of the last 4
    with pytest.raises(EnvFailureRateError, match="3 of the last 4"):
        rate.record("error")
    with pytest.raises(ConfigError):
        FailureRate(0.0, 4)


async def test_eval_counts_failures_never_scores_them_and_never_stops_the_run(inference_client, tiny_chat):
    from rollflow.config import load_config
    from rollflow.orchestrator.env_eval import open_env_evaluator
    from rollflow.rollout.envs import ENV_TASK, EnvTasks
    from rollflow.rollout.tasks import TaskItem

    # Greedy runs first (attempt 0 of sample 0), then the two sampled trajectories of each prompt.
    env = ScriptedEnv({(0, 0, 0): "raise", (1, 0, 1): "own_timeout", (1, 1, 0): "own_timeout"})

    def held_out(first, count):
        items = [
            TaskItem(messages=[{"role": "user", "content": "hi"}], metadata={ENV_TASK: first + i})
            for i in range(count)
        ]
        return EnvTasks("scripted", items, source=env)

    env.held_out = held_out
    config = load_config(
        [],
        [
            "env.kind='verifiers'",
            "env.id='scripted'",
            "env.max_seq_len=64",
            "env.num_tasks=2",
            # A limit the training run would pass with these failures: evaluation does not count toward it.
            "env.max_failure_rate=0.1",
            "env.failure_window=2",
            "sampling.max_tokens=4",
            "eval.num_prompts=2",
            "eval.samples=2",
        ],
    )
    chat = (tiny_chat.renderer, tiny_chat.tokenizer)
    async with open_env_evaluator(config, inference_client, *chat, env) as evaluator:
        metrics = await evaluator.evaluate(0)
    assert env.attempts == {(0, 0): 2, (0, 1): 1, (1, 0): 2, (1, 1): 1}  # never retried
    assert metrics["eval/env_errors"] == 1 and metrics["eval/env_timeouts"] == 2
    assert metrics["eval/reward_errors"] == 0
    # Means over the scored trajectories only (each scored one has reward 1): failures are not zeros.
    assert metrics["eval/greedy/reward_mean"] == 1.0 and metrics["eval/greedy/accuracy"] == 1.0
    assert metrics["eval/sampled/reward_mean"] == 1.0
    assert metrics["eval/sampled/pass@1"] == 1.0 and metrics["eval/sampled/pass@2"] == 1.0
