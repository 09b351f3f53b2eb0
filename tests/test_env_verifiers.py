"""``env.kind = "verifiers"``: environments written with verifiers' own classes (``verifiers.v1``), run by
``EnvGenerator`` through a real ``TITOProxy`` over the tiny model (the ``inference_client`` fixture): the
single-turn case taskset of ``examples/envs`` (a ``@vf.reward`` rubric) and a multi-turn tool environment
(a ``vf.Toolset`` MCP server in verifiers' subprocess runtime, ``tests/helpers/vf_tool_env.py``). Rewards
equal verifiers' own reward functions on the same completions; sampled tokens carry the model's own
logprobs. The tool call turn is forced (``ScriptedPolicy``): the tiny model does not write tool calls."""

from __future__ import annotations

import json
import types

import pytest

from rollflow.config import EnvConfig
from rollflow.messages import RolloutRequest
from rollflow.tito import TITOProxy
from tests.helpers.tito import MODEL, ScriptedPolicy

from .conftest import REPO_ROOT

pytest.importorskip("verifiers.v1", reason="needs pip install 'rollflow[envs]'")

from rollflow.rollout.envs import ENV_TASK, EnvGenerator
from rollflow.rollout.envs.verifiers_env import VerifiersSource

CASE_ENV = str(REPO_ROOT / "examples" / "envs" / "case_env.py")
TOOL_ENV = str(REPO_ROOT / "tests" / "helpers" / "vf_tool_env.py")
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}


def env_config(path: str, **fields) -> EnvConfig:
    return EnvConfig(kind="verifiers", id=path, args=LOCAL, max_seq_len=512, **fields)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from rollflow.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_dir)


def request(source, index: int, num_samples: int) -> RolloutRequest:
    item = source.task.item(index)
    return RolloutRequest(
        prompt_index=index, messages=item.messages, metadata=item.metadata, num_samples=num_samples
    )


def served_reply(tiny_chat, ids: list[int]) -> str:
    """The last assistant reply of ``ids`` as the proxy served it (what verifiers scores as the trace's
    ``last_reply``): the renderer's parse of the last turn, reasoning and tool calls split off, not the raw
    decode of its tokens (which keeps a ``<think>`` block's text, for one)."""
    from rollflow.tito.renderer import TITORenderer

    marker = tiny_chat.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    start = max(
        i + len(marker) for i in range(len(ids) - len(marker) + 1) if ids[i : i + len(marker)] == marker
    )
    parsed = TITORenderer(tiny_chat.renderer, tiny_chat.tokenizer).parse(ids[start:], None, ids[:start])
    return parsed.content.strip()


def model_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float()[:-1], dim=-1)


async def test_single_turn_rubric_rewards_and_exact_tokens(inference_client, tiny_chat, tiny_model):
    source = VerifiersSource(env_config(CASE_ENV, num_tasks=4), MODEL)
    assert len(source.task) == 4
    async with (
        source,
        TITOProxy(
            inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=8
        ) as proxy,
    ):
        generator = EnvGenerator(proxy, source, max_seq_len=512)
        groups = [await generator.generate_group(request(source, index, 3)) for index in range(2)]
        # One model client for every trajectory (each reaches its own session through the router).
        assert [len(server.clients) for server in source.env._interception.servers] == [1]
    checked = 0
    for group in groups:
        assert group.metrics["env_errors"] == group.metrics["env_timeouts"] == 0
        assert len(group.samples) == 3 and not any(sample.masked for sample in group.samples)
        vf_task = source.tasks[source.task.item(group.prompt_index).metadata[ENV_TASK]]
        for sample in group.samples:
            reply = served_reply(tiny_chat, sample.prompt_token_ids + sample.completion_token_ids)
            # verifiers' own reward function of the task, on the same completion.
            own = await vf_task.case(types.SimpleNamespace(last_reply=reply))
            assert sample.reward == pytest.approx(own, abs=1e-6)
            logprobs = model_logprobs(tiny_model, sample.prompt_token_ids + sample.completion_token_ids)
            offset = len(sample.prompt_token_ids)
            for i, token in enumerate(sample.completion_token_ids):
                if sample.loss_mask[i]:
                    assert abs(logprobs[offset + i - 1, token].item() - sample.logprobs[i]) <= 1e-4
                    checked += 1
        rewards = [sample.reward for sample in group.samples]
        assert group.metrics["reward_sum/case"] == pytest.approx(sum(rewards))
        assert group.metrics["reward_count/case"] == 3
    assert checked > 0


@pytest.mark.slow
async def test_multi_turn_tool_environment(inference_client, tiny_chat, tiny_model):
    def script(call, request):
        prompt = tiny_chat.tokenizer.decode(request.prompt_token_ids)
        if "<tool_response>" not in prompt:  # each episode's first call: the tool call
            return '<tool_call>\n{"name": "add_toolset_add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        return None  # the answer after the tool result: the tiny model's own sample

    policy = ScriptedPolicy(inference_client, tiny_chat.tokenizer, script)
    source = VerifiersSource(env_config(TOOL_ENV, num_tasks=1), MODEL)
    async with (
        source,
        TITOProxy(
            policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
        ) as proxy,
    ):
        generator = EnvGenerator(proxy, source, max_seq_len=1024, max_concurrent=1)
        group = await generator.generate_group(request(source, 0, 2))
    assert group.metrics["env_errors"] == 0, group
    assert group.metrics["agent_turns"] == 4  # two model calls per episode
    vf_task = source.tasks[0]
    for sample in group.samples:
        assert not sample.masked
        text = tiny_chat.tokenizer.decode(sample.completion_token_ids, skip_special_tokens=False)
        assert "<tool_call>" in text and "5" in text  # the call, then the tool's answer as context
        # The tool's answer is context, not trained; the model's tokens around it are.
        assert not all(sample.loss_mask) and any(sample.loss_mask)
        reply = served_reply(tiny_chat, sample.prompt_token_ids + sample.completion_token_ids)
        messages = [types.SimpleNamespace(role="tool")]
        trace = types.SimpleNamespace(last_reply=reply, messages=messages)
        own = await vf_task.correct(trace) + 0.5 * await vf_task.used_tool(trace)
        assert sample.reward == pytest.approx(own, abs=1e-6)
    assert group.metrics["reward_sum/used_tool"] == 2
    # The last call of each episode was the tiny model's own sample: its logprobs are the model's.
    prompt, sampled = policy.calls[-1]
    logprobs = model_logprobs(tiny_model, prompt + sampled)
    full = prompt + sampled
    sample = next(
        s for s in group.samples if (s.prompt_token_ids + s.completion_token_ids)[: len(full)] == full
    )
    start = len(prompt) - len(sample.prompt_token_ids)
    for i, token in enumerate(sampled):
        assert sample.loss_mask[start + i]
        assert abs(logprobs[len(prompt) + i - 1, token].item() - sample.logprobs[start + i]) <= 1e-4


def test_bad_environment_is_a_config_error():
    from rollflow.errors import ConfigError

    with pytest.raises(ConfigError, match="env.id = 'no_such_taskset_xyz'"):
        VerifiersSource(env_config("no_such_taskset_xyz"), MODEL)
    with pytest.raises(ConfigError, match="no such file"):
        VerifiersSource(env_config("missing/dir/env.py"), MODEL)
    assert json.dumps(LOCAL)


CASE_TOML = REPO_ROOT / "examples" / "envs" / "verifiers_case.toml"


class Recording:
    """A generator that keeps every group the one it wraps made (to score their completions again)."""

    def __init__(self, generator):
        self.generator = generator
        self.groups = []

    async def generate_group(self, request):
        group = await self.generator.generate_group(request)
        self.groups.append(group)
        return group


async def test_eval_of_held_out_tasks_matches_the_environments_own_scoring(
    inference_client, tiny_chat, tiny_model, tmp_path
):
    from rollflow.config import load_config
    from rollflow.orchestrator.env_eval import open_env_evaluator

    overrides = [f"output_dir='{tmp_path}'", "env.num_tasks=8", "eval.num_prompts=3", "eval.samples=2"]
    import msgspec

    config = load_config([CASE_TOML], [*overrides, "eval.pass_threshold=0.5"])
    # Without the example's eval.env_args: the tasks after the training ones.
    config = msgspec.structs.replace(config, eval=msgspec.structs.replace(config.eval, env_args=None))
    async with open_env_evaluator(config, inference_client, tiny_chat.renderer, tiny_chat.tokenizer) as ev:
        ev.generators = {kind: (Recording(gen), n) for kind, (gen, n) in ev.generators.items()}
        metrics = await ev.evaluate(0)
    source = ev.task.source
    # The tasks after the 8 training ones, never trained (the training source's own tasks are 0 .. 7).
    assert [ev.task.item(i).metadata[ENV_TASK] for i in range(3)] == [8, 9, 10]
    assert metrics["eval/env_errors"] == metrics["eval/env_timeouts"] == 0
    own: dict[str, list[list[float]]] = {}
    for kind, (recording, samples) in ev.generators.items():
        own[kind] = []
        for group in sorted(recording.groups, key=lambda g: g.prompt_index):
            assert len(group.samples) == samples and not any(s.masked for s in group.samples)
            vf_task = source._by_index[ev.task.item(group.prompt_index).metadata[ENV_TASK]]
            rewards = []
            for sample in group.samples:
                ids = sample.prompt_token_ids + sample.completion_token_ids
                reply = served_reply(tiny_chat, ids)
                rewards.append(await vf_task.case(types.SimpleNamespace(last_reply=reply)))
                assert sample.reward == pytest.approx(rewards[-1], abs=1e-6)
                if kind == "greedy":  # temperature 0: every sampled token is the model's argmax
                    logprobs = model_logprobs(
                        tiny_model, sample.prompt_token_ids + sample.completion_token_ids
                    )
                    offset = len(sample.prompt_token_ids)
                    for i, token in enumerate(sample.completion_token_ids):
                        if sample.loss_mask[i]:
                            assert logprobs[offset + i - 1].argmax().item() == token
            own[kind].append(rewards)
    greedy = [rewards[0] for rewards in own["greedy"]]
    assert metrics["eval/greedy/reward_mean"] == pytest.approx(sum(greedy) / 3)
    assert metrics["eval/greedy/accuracy"] == pytest.approx(sum(r >= 0.5 for r in greedy) / 3)
    sampled = own["sampled"]
    assert metrics["eval/sampled/reward_mean"] == pytest.approx(sum(map(sum, sampled)) / 6)
    assert metrics["eval/sampled/pass@1"] == pytest.approx(
        sum(sum(r >= 0.5 for r in rewards) / 2 for rewards in sampled) / 3
    )
    assert metrics["eval/sampled/pass@2"] == pytest.approx(
        sum(any(r >= 0.5 for r in rewards) for rewards in sampled) / 3
    )

    # eval.env_args: another taskset (the example's: another seed of the case prompts), its first
    # eval.num_prompts.
    from rollflow.rollout.tasks import CaseTask

    config = load_config([CASE_TOML], [*overrides, "eval.samples=0"])
    assert config.eval.env_args == {"taskset": {"seed": 1}}  # the example's
    async with open_env_evaluator(config, inference_client, tiny_chat.renderer, tiny_chat.tokenizer) as ev:
        prompts = [ev.task.item(i).messages[-1]["content"] for i in range(3)]
    assert prompts == [CaseTask(1).item(i).messages[0]["content"] for i in range(3)]
    assert prompts != [CaseTask(0).item(i).messages[0]["content"] for i in range(3)]


async def test_a_run_with_env_and_eval_evaluates_before_and_after_training(tmp_path):
    """The example's [eval]: its eval.env_args (another seed of the taskset) as the held-out environment."""
    import json

    from rollflow import Orchestrator
    from rollflow.config import load_config

    config = load_config(
        [CASE_TOML],
        [
            f"output_dir='{tmp_path}'",
            "env.num_tasks=4",
            "sampling.samples_per_prompt=2",
            "orchestrator.prompts_per_step=2",
            "orchestrator.steps=1",
            "checkpoint.every=0",
            "eval.num_prompts=2",
            "eval.samples=2",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
        # Evaluation keeps failure counts of its own: the run's limit sees only trained attempts.
        assert orchestrator.evaluator.generators["greedy"][0].failure_rate is not (
            orchestrator.generator.failure_rate
        )
    assert len(metrics) == 1 and metrics[0]["env_trajectories"] == 4  # the training trajectories only
    lines = (tmp_path / "verifiers-case" / "metrics.jsonl").read_text().splitlines()
    evals = [record for record in map(json.loads, lines) if "eval/greedy/reward_mean" in record]
    assert [record["step"] for record in evals] == [0, 1]
    for record in evals:
        assert record["eval/env_errors"] == record["eval/env_timeouts"] == 0
        assert 0 <= record["eval/greedy/reward_mean"] <= 1 and record["eval/num_prompts"] == 2
        assert record["eval/sampled/pass@1"] <= record["eval/sampled/pass@2"]
