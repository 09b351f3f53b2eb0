"""``AgentGenerator`` over a real ``TITOProxy`` and the tiny model in the suite's inference mode (the
``inference_client`` fixture): callable agents written with the official ``openai`` SDK, the example's
summarizing agent, timeouts, failures, command agents, and ``rollflow generate`` end to end."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from typing import Any

import openai
import pytest

from rollflow.messages import RolloutRequest, ScoredGroup
from rollflow.rollout.agent import AgentGenerator, CommandAgent
from rollflow.tito import TITOProxy, compose
from tests.helpers.tito import MODEL
from tests.helpers.waits import wait_until

from .conftest import REPO_ROOT

EXAMPLE_AGENT = REPO_ROOT / "examples" / "agent_tito" / "agent.py"
EXAMPLE_CONFIG = REPO_ROOT / "examples" / "agent_tito" / "config.toml"


@pytest.fixture
async def proxy(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=8
    ) as p:
        yield p


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from rollflow.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_dir)


def request(num_samples: int, prompt_index: int = 0, content: str = "name a fruit") -> RolloutRequest:
    return RolloutRequest(
        prompt_index=prompt_index,
        messages=[{"role": "user", "content": content}],
        answer=7,
        num_samples=num_samples,
    )


def assert_exact_logprobs(model, samples) -> int:
    """Every trainable token's recorded logprob equals the model's own on the sample's tokens; returns how
    many were checked."""
    import torch

    checked = 0
    for sample in samples:
        ids = sample.prompt_token_ids + sample.completion_token_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float()[:-1], dim=-1)
        offset = len(sample.prompt_token_ids)
        for i, (token, recorded, trained) in enumerate(
            zip(sample.completion_token_ids, sample.logprobs, sample.loss_mask, strict=True)
        ):
            if trained:
                assert abs(logprobs[offset + i - 1, token].item() - recorded) < 1e-4
                checked += 1
            else:
                assert recorded == 0.0
    return checked


@pytest.mark.slow
async def test_callable_openai_agent_gives_exact_samples(proxy, tiny_model):
    seen, sampled = [], []

    async def agent(base_url, task):
        seen.append(task)
        task.messages.append({"role": "user", "content": "an agent may edit its own task"})
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            messages = task.messages[:1]
            for turn in range(2):
                response = await client.chat.completions.create(
                    model=task.model, messages=messages, seed=task.seed + turn
                )
                sampled.append(response.usage.completion_tokens)
                messages += [response.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": "and another"}]
        return 0.25

    generator = AgentGenerator(proxy, agent, max_seq_len=512, timeout_s=30, seed=1)
    rollout = request(2, prompt_index=3)
    group = await generator.generate_group(rollout)
    assert len(rollout.messages) == 1 and all(len(task.messages) == 2 for task in seen)

    assert group.prompt_index == 3 and [s.sample_index for s in group.samples] == [0, 1]
    assert {(t.prompt_index, t.sample_index, t.answer, t.model) for t in seen} == {
        (3, 0, 7, MODEL),
        (3, 1, 7, MODEL),
    }
    assert seen[0].seed != seen[1].seed
    for sample in group.samples:
        assert sample.reward == 0.25 and not sample.masked and sample.prompt_index == 3
        assert sample.loss_mask[0] and not all(sample.loss_mask)  # the user turn between is context
    # Loss masks cover exactly the sampled tokens, whose logprobs are the model's own.
    assert sum(sum(s.loss_mask) for s in group.samples) == sum(sampled)
    assert assert_exact_logprobs(tiny_model, group.samples) == sum(sampled)
    metrics = group.metrics
    assert (
        metrics["agent_trajectories"] == 2 and metrics["agent_turns"] == 4 and metrics["agent_branches"] == 2
    )
    assert metrics["agent_bridged_turns"] == 2 and metrics["agent_errors"] == metrics["agent_timeouts"] == 0


async def test_summarizing_example_agent_branches(proxy, tiny_model):
    from rollflow.imports import import_object

    traces = []

    def recording_composer(trace, **options):
        traces.append(trace)
        return compose(trace, **options)

    agent = import_object(f"{EXAMPLE_AGENT}:run_agent", key="agent.callable")
    task = import_object(f"{EXAMPLE_AGENT}:ArithmeticTask", key="data.task")(0)
    item = task.item(5)
    generator = AgentGenerator(proxy, agent, composer=recording_composer, max_seq_len=1024, timeout_s=60)
    group = await generator.generate_group(
        RolloutRequest(prompt_index=5, messages=item.messages, answer=item.answer, num_samples=2)
    )

    assert len(traces) == 2 and len(group.samples) == 4  # two branches per trajectory
    # Both branches of a run are one trajectory: one unit of the group's baseline.
    assert [s.trajectory for s in group.samples] == [0, 0, 1, 1]
    assert [s.sample_index for s in group.samples] == [0, 1, 2, 3]
    metrics = group.metrics
    assert (
        metrics["agent_branches"] == 4 and metrics["agent_forked_turns"] == 2 and metrics["agent_turns"] == 6
    )
    assert metrics["agent_full_render_turns"] >= 2  # the rewritten history cannot be bridged
    sampled = sum(len(turn.completion_ids) for trace in traces for turn in trace.turns)
    assert sum(sum(s.loss_mask) for s in group.samples) == sampled  # each sampled token trained once
    assert assert_exact_logprobs(tiny_model, group.samples) == sampled
    assert all(0.0 <= s.reward <= 1.0 and not s.masked for s in group.samples)


RECORDING_COMPOSER = """
from rollflow.tito import compose

TRACES = []


def recorded():
    return TRACES


def composer(trace, **options):
    TRACES.append(trace)
    return compose(trace, **options)
"""


@pytest.mark.slow
async def test_the_proxy_in_a_worker_process_gives_the_same_samples(
    inference_client, tiny_chat, tiny_model, tmp_path
):
    """``build_agent_generator`` as ``rollflow run`` builds it from the example config, with the proxy in
    this process and with ``agent.proxy_workers = 1`` (in a worker process): the agent's seeded calls give
    the same composed samples (tokens, loss masks, logprobs, rewards) and trace metrics either way."""
    from rollflow.config import load_config
    from rollflow.imports import import_object
    from rollflow.orchestrator.builders import build_agent_generator
    from rollflow.tito.workers import ProxyWorkers

    task = import_object(f"{EXAMPLE_AGENT}:ArithmeticTask", key="data.task")(0)
    item = task.item(5)
    rollout = RolloutRequest(prompt_index=5, messages=item.messages, answer=item.answer, num_samples=2)

    async def run(proxy_workers: int) -> tuple[ScoredGroup, list[Any]]:
        composer = tmp_path / f"composer_{proxy_workers}.py"  # its own module, so its own list of traces
        composer.write_text(RECORDING_COMPOSER)
        overrides = [f"agent.proxy_workers={proxy_workers}", f"agent.composer='{composer}:composer'"]
        config = load_config([EXAMPLE_CONFIG], [*overrides, f"output_dir={tmp_path}"])
        chat = (inference_client, tiny_chat.renderer, tiny_chat.tokenizer)
        async with build_agent_generator(config, *chat) as generator:
            assert isinstance(generator.proxy, ProxyWorkers) is (proxy_workers > 0)
            assert generator.proxy.model_name == MODEL
            group = await generator.generate_group(rollout)
            assert not generator.proxy.sessions
        return group, import_object(f"{composer}:recorded", key="agent.composer")()

    here, _ = await run(0)
    group, traces = await run(1)

    assert len(traces) == 2 and len(group.samples) == 4  # two branches per trajectory
    assert [s.trajectory for s in group.samples] == [0, 0, 1, 1]
    metrics = group.metrics
    assert (metrics["agent_trajectories"], metrics["agent_turns"], metrics["agent_branches"]) == (2, 6, 4)
    assert (metrics["agent_bridged_turns"], metrics["agent_forked_turns"]) == (2, 2)
    assert metrics["agent_errors"] == metrics["agent_timeouts"] == 0
    assert {k: v for k, v in metrics.items() if k.startswith("agent_")} == {
        k: v for k, v in here.metrics.items() if k.startswith("agent_")
    }
    sampled = sum(len(turn.completion_ids) for trace in traces for turn in trace.turns)
    assert sum(sum(s.loss_mask) for s in group.samples) == sampled  # each sampled token trained once
    assert assert_exact_logprobs(tiny_model, group.samples) == sampled
    assert all(not s.masked and 0.0 <= s.reward <= 1.0 for s in group.samples)
    for sample, reference in zip(group.samples, here.samples, strict=True):
        assert sample.prompt_token_ids == reference.prompt_token_ids
        assert sample.completion_token_ids == reference.completion_token_ids
        assert (sample.loss_mask, sample.reward, sample.trajectory) == (
            reference.loss_mask,
            reference.reward,
            reference.trajectory,
        )
        assert sample.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@pytest.mark.slow
async def test_timeout_masks_and_counts_a_timeout(proxy, inference_backend):
    async def slow_agent(base_url, task):
        if task.sample_index == 0:
            async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                await client.chat.completions.create(model=task.model, messages=task.messages)
        await asyncio.sleep(60)
        return 1.0

    # 2 s: time for sample 0's call to finish on a loaded machine before its agent is cut.
    started = time.perf_counter()
    group = await AgentGenerator(proxy, slow_agent, max_seq_len=512, timeout_s=2).generate_group(request(2))
    assert time.perf_counter() - started < 30  # cut at the timeout, not after the agents' 60 s
    assert [s.mask_reason for s in group.samples] == ["timeout", "timeout"]
    assert all(s.masked for s in group.samples)
    assert len(group.samples[0].completion_token_ids) > 0  # the call it made is kept, masked
    assert group.metrics["agent_timeouts"] == 2 and group.metrics["agent_errors"] == 0
    assert not proxy.sessions

    async def idle() -> bool:
        return not await inference_backend.running_requests()

    # The timed-out call's abort reaches the engine (over HTTP, a moment later).
    await wait_until(idle, "the timed-out call's engine request ends")


async def test_failing_agents_are_masked_and_counted_as_errors(proxy):
    async def agent(base_url, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            await client.chat.completions.create(model=task.model, messages=task.messages)
        if task.sample_index == 0:
            raise RuntimeError("tool crashed")
        return [None, math.nan, math.nan, "1.0", True, 1.0][task.sample_index]

    group = await AgentGenerator(proxy, agent, max_seq_len=512, timeout_s=30).generate_group(request(6))
    assert [s.mask_reason for s in group.samples] == ["error"] * 5 + [None]
    assert group.samples[5].reward == 1.0 and len(group.samples[0].completion_token_ids) > 0
    assert group.metrics["agent_errors"] == 5 and group.metrics["agent_timeouts"] == 0

    async def raising(base_url, task):
        raise ValueError("before any call")

    group = await AgentGenerator(proxy, raising, max_seq_len=512, timeout_s=30).generate_group(request(1))
    (sample,) = group.samples  # no call was made: an empty masked sample still stands for the trajectory
    assert sample.masked and sample.mask_reason == "error" and sample.completion_token_ids == []
    assert group.metrics["agent_errors"] == 1 and not proxy.sessions


COMMAND_AGENT = """
import json, os, sys
from openai import OpenAI
task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
response = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["messages"])
print("log line the generator ignores")
print(0.5 + task["sample_index"] + (task["answer"] == 7) * 0.25)
"""


@pytest.mark.slow
async def test_command_agents(proxy, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT)
    generator = AgentGenerator(
        proxy, CommandAgent([sys.executable, str(script)]), max_seq_len=512, timeout_s=60
    )
    group = await generator.generate_group(request(2))
    assert [s.reward for s in group.samples] == [0.75, 1.75]
    assert not any(s.masked for s in group.samples) and all(sum(s.loss_mask) > 0 for s in group.samples)
    assert group.metrics["agent_turns"] == 2

    failing = {
        "echo 'not a number'": "error",
        "echo 1.0; echo oops >&2; exit 3": "error",
        "sleep 30": "timeout",
    }
    for command, reason in failing.items():  # 2 s: time for the echoes to end on a loaded machine
        started = time.perf_counter()
        group = await AgentGenerator(
            proxy, CommandAgent(command, kill_grace_s=0.5), max_seq_len=512, timeout_s=2
        ).generate_group(request(1))
        assert [s.mask_reason for s in group.samples] == [reason], command
        assert time.perf_counter() - started < 20  # "sleep 30" is cut at the timeout


def test_rollflow_generate_writes_jsonl(tmp_path, monkeypatch):
    from rollflow.cli import main

    monkeypatch.chdir(REPO_ROOT)  # the example config's paths are relative to the repository root
    config = REPO_ROOT / "examples" / "agent_tito" / "config.toml"
    output = tmp_path / "samples.jsonl"
    sets = ["--set", "sampling.samples_per_prompt=2", "--set", f"output_dir={tmp_path}"]
    assert main(["generate", str(config), *sets, "--num-prompts", "2", "--output", str(output)]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(line["prompt_index"], line["sample_index"]) for line in lines] == [(0, i) for i in range(4)] + [
        (1, i) for i in range(4)
    ]
    for line in lines:
        assert len(line["loss_mask"]) == len(line["completion_token_ids"]) == len(line["logprobs"])
        assert 0.0 <= line["reward"] <= 1.0 and line["masked"] is False

    # Single-turn (no [agent]) through the same command, output into the run directory by default.
    assert (
        main(
            [
                "generate",
                str(REPO_ROOT / "examples" / "quickstart.toml"),
                *sets[2:],
                "--set",
                "name=q",
                "--set",
                "sampling.samples_per_prompt=3",
                "--num-prompts",
                "2",
            ]
        )
        == 0
    )
    lines = (tmp_path / "q" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["loss_mask"] is None
    # An agent config without max_seq_len is a usage error.
    assert main(["generate", str(config), "--set", "agent.max_seq_len=0"]) == 2


@pytest.mark.slow
@pytest.mark.follows_mode
@pytest.mark.parametrize("schedule", ["sync", "fully_async"])
def test_rollflow_run_trains_the_agent_example(tmp_path, schedule):
    """In the suite's inference mode (the run reads ``$ROLLFLOW_INFERENCE_MODE``); in ``http`` mode the
    agent's calls go proxy → router → 2 engine servers."""
    import subprocess

    from .helpers.clients import suite_inference_mode

    mode = suite_inference_mode()

    sets = [
        f"orchestrator.mode={schedule}",
        "orchestrator.steps=2",
        "orchestrator.prompts_per_step=2",
        "sampling.samples_per_prompt=2",
        f"output_dir={tmp_path}",
        "inference.router_port=0",
    ]
    command = [sys.executable, "-m", "rollflow", "run", "examples/agent_tito/config.toml", "--no-progress"]
    for value in sets:
        command += ["--set", value]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "agent_tito" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert record["num_samples"] == 8  # 2 prompts x 2 trajectories x 2 branches
        assert record["agent_branches"] == 8 and record["agent_forked_turns"] == 4
        assert record["agent_errors"] == record["agent_timeouts"] == 0
    if mode == "http":  # the agent's requests reached both servers through the router
        logs = tmp_path / "agent_tito" / "logs" / "inference"
        assert (logs / "router-0.log").exists() and len(list(logs.glob("server-*.log"))) == 2
