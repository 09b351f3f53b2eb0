"""Held-out evaluation (``[eval]``): greedy and sampled completions of the held-out prompts, scored by the
run's reward.

The orchestrator evaluates between steps, on the engines that generate for training: evaluation requests
carry ids of their own (``eval-…``), go through no staleness schedule and are never trained, so the run's
staleness accounting does not see them; no weight update happens while they run, so every evaluation sample
is of one policy version. ``rollflow eval`` (``rollflow.orchestrator.offline.evaluate_offline``) does the same on a checkpoint's
weights.

Metrics: ``eval/greedy/reward_mean`` and ``eval/greedy/accuracy`` (reward >= ``eval.pass_threshold``);
``eval/sampled/reward_mean``, ``eval/sampled/pass@1`` (mean fraction correct) and ``eval/sampled/pass@k``
(prompts with at least one correct of k = ``eval.samples``); ``eval/num_prompts``, ``eval/reward_errors``,
``eval/time_s``, ``eval/policy_version``.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import msgspec

from rollflow.config import EvalConfig, RunConfig
from rollflow.messages import ScoredGroup


def eval_task(config: RunConfig, evaluation: EvalConfig) -> Any:
    """The held-out task: ``eval.path`` / ``eval.split`` of a dataset (file order), or a generated task's
    stream under ``eval.seed``.

    Raises:
        ConfigError: see ``rollflow.rollout.datasets.task_from_config``.
    """
    from rollflow.rollout.datasets import task_from_config

    data = config.data
    if evaluation.path is not None or data.path is not None:
        path = evaluation.path if evaluation.path is not None else data.path
        task = task_from_config(data, path=path, split=evaluation.split, key="eval")
        task.shuffle = False  # the first num_prompts rows, the same ones at every evaluation
        return task
    seed = data.seed + 1 if evaluation.seed is None else evaluation.seed
    return task_from_config(msgspec.structs.replace(data, seed=seed))


class Evaluator:
    """Evaluates the policy the engines behind ``client`` hold on the held-out prompts."""

    def __init__(
        self, config: RunConfig, client: Any, renderer: Any, task: Any | None = None, tokenizer: Any = None
    ):
        """Args:
        config, client, renderer: the run's.
        task: the held-out task (default: ``eval_task``).
        tokenizer: the model's, for the character bound of prompts that cannot fit the context
            (``PromptLimit``; without it, a bound that any vocabulary meets).

        Raises:
            ConfigError: the held-out set or the reward does not resolve.
        """
        from rollflow.rollout.generator import PromptLimit, SingleTurnGenerator
        from rollflow.rollout.rewards import Rewarder

        self.evaluation = evaluation = config.eval or EvalConfig()
        self.task = eval_task(config, evaluation) if task is None else task
        size = len(self.task) if hasattr(self.task, "__len__") else evaluation.num_prompts
        self.num_prompts = min(evaluation.num_prompts, size)
        self.max_inflight = config.orchestrator.max_inflight
        rewarder = Rewarder.from_config(
            config.data.reward, self.task, config.data.rewards, timeout_s=config.data.reward_timeout_s
        )
        limit = PromptLimit.from_config(config, tokenizer, self.task)
        self.task_timeout_s = config.data.task_timeout_s
        max_tokens = evaluation.max_tokens or config.sampling.max_tokens
        self.generators: dict[str, tuple[Any, int]] = {}
        if evaluation.greedy:
            greedy = msgspec.structs.replace(
                config.sampling, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens
            )
            self.generators["greedy"] = (
                SingleTurnGenerator(
                    client,
                    renderer,
                    rewarder,
                    greedy,
                    seed=config.seed,
                    request_prefix="eval-g-",
                    prompt_limit=limit,
                    tokenizer=tokenizer,
                ),
                1,
            )
        if evaluation.samples > 0:
            temperature = (
                config.sampling.temperature if evaluation.temperature is None else evaluation.temperature
            )
            sampled = msgspec.structs.replace(config.sampling, temperature=temperature, max_tokens=max_tokens)
            self.generators["sampled"] = (
                SingleTurnGenerator(
                    client,
                    renderer,
                    rewarder,
                    sampled,
                    seed=config.seed,
                    request_prefix="eval-s-",
                    prompt_limit=limit,
                    tokenizer=tokenizer,
                ),
                evaluation.samples,
            )

    async def evaluate(self, policy_version: int) -> dict[str, float]:
        """Generate and score every held-out prompt with each configured kind; the ``eval/*`` metrics."""
        from rollflow.rollout.prompt_groups import generate_groups

        started = time.perf_counter()
        metrics: dict[str, float] = {"eval/num_prompts": float(self.num_prompts), "eval/reward_errors": 0.0}
        for kind, (generator, samples) in self.generators.items():
            groups = [
                group
                async for group in generate_groups(
                    generator,
                    self.task,
                    self.num_prompts,
                    samples_per_prompt=samples,
                    max_concurrent=self.max_inflight,
                    item_timeout_s=self.task_timeout_s,
                )
            ]
            metrics.update(self._kind_metrics(kind, groups, samples))
            metrics["eval/reward_errors"] += sum(s.masked for g in groups for s in g.samples)
        metrics["eval/policy_version"] = float(policy_version)
        metrics["eval/time_s"] = time.perf_counter() - started
        return metrics

    def _kind_metrics(self, kind: str, groups: list[ScoredGroup], samples: int) -> dict[str, float]:
        threshold = self.evaluation.pass_threshold
        rewards = [s.reward for g in groups for s in g.samples if not s.masked]
        correct = [sum(not s.masked and s.reward >= threshold for s in g.samples) for g in groups]
        reward_mean = statistics.fmean(rewards) if rewards else math.nan
        if kind == "greedy":
            return {
                "eval/greedy/reward_mean": reward_mean,
                "eval/greedy/accuracy": statistics.fmean(c > 0 for c in correct),
            }
        return {
            "eval/sampled/reward_mean": reward_mean,
            "eval/sampled/pass@1": statistics.fmean(c / samples for c in correct),
            f"eval/sampled/pass@{samples}": statistics.fmean(c > 0 for c in correct),
        }
