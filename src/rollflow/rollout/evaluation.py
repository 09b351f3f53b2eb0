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
``eval/time_s``, ``eval/policy_version``. Means are over the trajectories that were scored: a completion
whose reward failed, or an environment trajectory that failed, counts in ``eval/reward_errors`` (with
``[env]``: ``eval/env_errors``, ``eval/env_timeouts``), never as a wrong answer.

With ``[env]`` the generators are ``EnvGenerator``s over the environment's held-out tasks (built by
``rollflow.orchestrator.env_eval``), one per kind, each behind a TITO proxy that enforces that kind's
sampling.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import msgspec

from rollflow.config import EvalConfig, RunConfig, SamplingConfig
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


def eval_sampling(config: RunConfig, evaluation: EvalConfig) -> dict[str, tuple[SamplingConfig, int]]:
    """The sampling of each configured kind and its completions per prompt: ``greedy`` (temperature 0,
    one) and ``sampled`` (``eval.temperature``, ``eval.samples``), both under ``eval.max_tokens``."""
    max_tokens = evaluation.max_tokens or config.sampling.max_tokens
    kinds: dict[str, tuple[SamplingConfig, int]] = {}
    if evaluation.greedy:
        greedy = msgspec.structs.replace(
            config.sampling, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens
        )
        kinds["greedy"] = (greedy, 1)
    if evaluation.samples > 0:
        temperature = (
            config.sampling.temperature if evaluation.temperature is None else evaluation.temperature
        )
        sampled = msgspec.structs.replace(config.sampling, temperature=temperature, max_tokens=max_tokens)
        kinds["sampled"] = (sampled, evaluation.samples)
    return kinds


class Evaluator:
    """Evaluates the policy the engines behind ``client`` hold on the held-out prompts."""

    def __init__(
        self,
        config: RunConfig,
        client: Any,
        renderer: Any,
        task: Any | None = None,
        tokenizer: Any = None,
        generators: dict[str, tuple[Any, int]] | None = None,
    ):
        """Args:
        config, client, renderer: the run's.
        task: the held-out task (default: ``eval_task``).
        tokenizer: the model's, for the character bound of prompts that cannot fit the context
            (``PromptLimit``; without it, a bound that any vocabulary meets).
        generators: each kind's generator and completions per prompt (with ``[env]``: ``EnvGenerator``s);
            default: ``SingleTurnGenerator``s scored by the run's reward, one per ``eval_sampling`` kind.

        Raises:
            ConfigError: the held-out set or the reward does not resolve.
        """
        self.evaluation = evaluation = config.eval or EvalConfig()
        self.task = eval_task(config, evaluation) if task is None else task
        size = len(self.task) if hasattr(self.task, "__len__") else evaluation.num_prompts
        self.num_prompts = min(evaluation.num_prompts, size)
        self.max_inflight = config.orchestrator.max_inflight
        self.task_timeout_s = config.data.task_timeout_s
        self.generators = (
            generators if generators is not None else self._single_turn(config, client, renderer, tokenizer)
        )

    def _single_turn(
        self, config: RunConfig, client: Any, renderer: Any, tokenizer: Any
    ) -> dict[str, tuple[Any, int]]:
        from rollflow.rollout.generator import PromptLimit, SingleTurnGenerator
        from rollflow.rollout.rewards import Rewarder

        rewarder = Rewarder.from_config(
            config.data.reward, self.task, config.data.rewards, timeout_s=config.data.reward_timeout_s
        )
        limit = PromptLimit.from_config(config, tokenizer, self.task)
        return {
            kind: (
                SingleTurnGenerator(
                    client,
                    renderer,
                    rewarder,
                    sampling,
                    seed=config.seed,
                    request_prefix=f"eval-{kind[0]}-",
                    prompt_limit=limit,
                    tokenizer=tokenizer,
                ),
                samples,
            )
            for kind, (sampling, samples) in eval_sampling(config, self.evaluation).items()
        }

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
            metrics["eval/reward_errors"] += sum(
                s.masked and not (s.mask_reason or "").startswith("env_") for g in groups for s in g.samples
            )
            for name in ("env_errors", "env_timeouts"):
                if any(name in g.metrics for g in groups):
                    key = f"eval/{name}"
                    metrics[key] = metrics.get(key, 0.0) + sum(g.metrics.get(name, 0.0) for g in groups)
        metrics["eval/policy_version"] = float(policy_version)
        metrics["eval/time_s"] = time.perf_counter() - started
        return metrics

    def _kind_metrics(self, kind: str, groups: list[ScoredGroup], samples: int) -> dict[str, float]:
        threshold = self.evaluation.pass_threshold
        scored = [trajectory_rewards(group) for group in groups]
        rewards = [reward for group in scored for reward in group]
        correct = [(sum(reward >= threshold for reward in group), len(group)) for group in scored if group]
        reward_mean = statistics.fmean(rewards) if rewards else math.nan
        if kind == "greedy":
            return {
                "eval/greedy/reward_mean": reward_mean,
                "eval/greedy/accuracy": _mean(float(c > 0) for c, _ in correct),
            }
        return {
            "eval/sampled/reward_mean": reward_mean,
            "eval/sampled/pass@1": _mean(c / n for c, n in correct),
            f"eval/sampled/pass@{samples}": _mean(float(c > 0) for c, _ in correct),
        }


def trajectory_rewards(group: ScoredGroup) -> list[float]:
    """The reward of each scored trajectory of ``group`` (an environment's trajectory may compose into
    several samples, which share its reward); a trajectory whose samples are all masked was not scored."""
    rewards: dict[Any, float] = {}
    for sample in group.samples:
        key = id(sample) if sample.trajectory is None else sample.trajectory
        if not sample.masked:
            rewards.setdefault(key, sample.reward)
    return list(rewards.values())


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else math.nan
