"""Generate-only and evaluate-only runs (``rollflow generate``, ``rollflow eval``): the configured generator — the agent (``[agent]``) or
single-turn — over the first N prompts of the task, written as JSONL. The engines hold the initial weights,
or a training checkpoint's (``--checkpoint``), pushed by the run's weight-transfer strategy.

Each line is one sample: ``prompt_index``, ``sample_index``, ``reward`` (its group's reward for that
trajectory), ``masked``, ``mask_reason``, ``finish_reason``, ``prompt_token_ids``, ``completion_token_ids``,
``logprobs``, ``loss_mask``, ``policy_versions``, ``completion_text``, ``routed_experts`` (null unless the
engines return routes, ``inference.return_routed_experts``). Lines are ordered by prompt, then sample.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from rollflow.config import EvalConfig, RunConfig
from rollflow.orchestrator.builders import load_chat, open_generator, push_policy
from rollflow.rollout.prompt_groups import generate_groups

SAMPLES_FILE = "samples.jsonl"


def _enc_hook(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays (routed experts)
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


async def generate_samples(
    config: RunConfig,
    *,
    num_prompts: int,
    output: str | Path | None = None,
    checkpoint: str | Path | None = None,
) -> dict[str, float]:
    """Generate ``num_prompts`` groups and write their samples as JSONL to ``output`` (default
    ``{run_dir}/samples.jsonl``; ``"-"``: stdout). With ``checkpoint`` (a checkpoint directory, or a run
    directory for its latest checkpoint) the engines first get its weights. Returns a summary: counts, the
    policy version sampled from, the mean reward of unmasked samples and the summed group metrics.

    Raises:
        ConfigError: ``num_prompts`` < 1, or the task, reward, agent or composer does not resolve.
        CheckpointError: ``checkpoint`` is not a checkpoint or run directory, or its files are unreadable.
    """
    from rollflow.errors import ConfigError
    from rollflow.inference.setup import get_inference_client
    from rollflow.orchestrator.checkpoint import load_policy_weights, resolve_checkpoint
    from rollflow.rollout.datasets import task_from_config
    from rollflow.rollout.rewards import reward_part_means

    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {num_prompts}")
    policy = None
    if checkpoint is not None:
        # Read before any engine starts, so a wrong path or a corrupt file fails at once.
        policy = await anyio.to_thread.run_sync(load_policy_weights, resolve_checkpoint(checkpoint))
    task = task_from_config(config.data)
    tokenizer, renderer = await anyio.to_thread.run_sync(load_chat, config)
    path = config.run_dir / SAMPLES_FILE if output is None else output
    summary: dict[str, float] = {
        "num_groups": 0.0,
        "num_samples": 0.0,
        "num_masked": 0.0,
        "policy_version": 0.0,
    }
    rewards: list[float] = []
    encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
    async with (
        get_inference_client(config) as client,
        open_generator(config, client, renderer, tokenizer, task) as generator,
    ):
        if policy is not None:
            await push_policy(config, client, *policy)
            summary["policy_version"] = float(policy[1])
        groups = generate_groups(
            generator,
            task,
            num_prompts,
            samples_per_prompt=config.sampling.samples_per_prompt,
            max_concurrent=config.orchestrator.max_inflight,
            item_timeout_s=config.data.task_timeout_s,
        )
        with _open_output(path) as out:
            async for group in groups:
                for sample in group.samples:
                    out.write(encoder.encode(sample) + b"\n")
                    rewards += [] if sample.masked else [sample.reward]
                summary["num_groups"] += 1
                summary["num_samples"] += len(group.samples)
                summary["num_masked"] += sum(sample.masked for sample in group.samples)
                for key, value in group.metrics.items():
                    summary[key] = summary.get(key, 0.0) + value
    summary["reward_mean"] = sum(rewards) / len(rewards) if rewards else math.nan
    reward_part_means(summary)
    return summary


@contextlib.contextmanager
def _open_output(path: str | Path):
    if str(path) == "-":
        yield _StdoutBytes(sys.stdout)
        sys.stdout.flush()
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        yield file


class _StdoutBytes:
    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode())


async def evaluate_offline(config: RunConfig, checkpoint: str | Path | None = None) -> dict[str, float]:
    """``rollflow eval``: start the configured engines, push the checkpoint's weights (a checkpoint or run
    directory; unset: the initial weights) and evaluate once.

    Raises:
        ConfigError: the held-out set or the reward does not resolve.
        CheckpointError: ``checkpoint`` is not a checkpoint or run directory, or its files are unreadable.
    """
    from rollflow.inference.setup import get_inference_client
    from rollflow.orchestrator.checkpoint import load_policy_weights, resolve_checkpoint
    from rollflow.rollout.evaluation import Evaluator, eval_task

    policy = None
    if checkpoint is not None:
        policy = await anyio.to_thread.run_sync(load_policy_weights, resolve_checkpoint(checkpoint))
    task = None
    if config.env is None:
        task = await anyio.to_thread.run_sync(eval_task, config, config.eval or EvalConfig())
    tokenizer, renderer = await anyio.to_thread.run_sync(load_chat, config)
    async with get_inference_client(config) as client, contextlib.AsyncExitStack() as stack:
        version = 0
        if policy is not None:
            await push_policy(config, client, *policy)
            version = policy[1]
        if config.env is not None:  # the environment's held-out tasks (rollflow.orchestrator.env_eval)
            from rollflow.orchestrator.env_eval import open_env_evaluator

            evaluator = await stack.enter_async_context(
                open_env_evaluator(config, client, renderer, tokenizer)
            )
        else:
            evaluator = Evaluator(config, client, renderer, task, tokenizer)
        return await evaluator.evaluate(version)
