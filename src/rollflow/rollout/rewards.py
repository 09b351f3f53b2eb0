"""Scoring completions: the task's reward, a built-in one (``math``, ``exact``, ``case``), a user function named
by import path, or a weighted sum of these (``data.rewards``).

A reward function is ``fn(completion: str, item: TaskItem) -> float``, sync or async. Sync functions run in a
worker thread (one hop per group), so a slow reward never stalls generation. A function that raises or
returns a non-finite number masks that one sample (scored 0, left out of the loss and its group's baseline);
the run goes on, the error is counted in ``reward_errors`` and logged with the reward's name and the prompt's
row. With ``data.rewards`` each part is also logged on its own: ``reward/NAME`` is its mean over the step's
samples it scored.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from rollflow.errors import ConfigError, RewardPartError
from rollflow.imports import import_object
from rollflow.messages import Sample
from rollflow.rollout.tasks import Task, TaskItem

log = structlog.get_logger(__name__)

RewardFn = Callable[[str, TaskItem], float | Awaitable[float]]

REWARD_ERROR = "reward_error"


REWARD_SUM = "reward_sum/"
REWARD_COUNT = "reward_count/"
"""Group metric prefixes of the parts of a weighted reward; the orchestrator turns them into ``reward/NAME``."""


def reward_part_means(metrics: dict[str, Any]) -> None:
    """In place: summed group metrics of a weighted reward's parts (``reward_sum/NAME``, ``reward_count/NAME``)
    to their means, ``reward/NAME``."""
    for key in [key for key in metrics if key.startswith(REWARD_SUM)]:
        name = key.removeprefix(REWARD_SUM)
        total, count = metrics.pop(key), metrics.pop(REWARD_COUNT + name, 0.0)
        metrics[f"reward/{name}"] = total / count if count else math.nan


def resolve_reward(spec: str, key: str) -> RewardFn:
    """A built-in reward name or ``package.module:function``."""
    from rollflow.rollout.builtin_rewards import BUILTIN_REWARDS

    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"{key} = {spec!r} is not a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))}) nor an import "
            "path of the form 'package.module:function'"
        )
    return import_object(spec, key=key)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    )


class WeightedReward:
    """``sum(weight * fn(completion, item))`` over named parts; the parts' values of the last group scored
    are kept for the group's metrics."""

    def __init__(self, parts: list[tuple[str, RewardFn, float]]):
        self.parts = parts

    async def __call__(self, completion: str, item: TaskItem) -> tuple[float, dict[str, float]]:
        values: dict[str, float] = {}
        total = 0.0
        for name, fn, weight in self.parts:
            try:
                if _is_async(fn):
                    value = await fn(completion, item)
                else:
                    value = await anyio.to_thread.run_sync(fn, completion, item)
            except Exception as error:
                raise RewardPartError(name, error) from error
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardPartError(name, ValueError(f"returned {value!r}, expected a finite float"))
            values[name] = float(value)
            total += weight * float(value)
        return total, values


class Rewarder:
    """Assigns rewards to the samples of one group, masking samples whose reward fails."""

    def __init__(self, reward_fn: RewardFn, name: str = "reward"):
        self.reward_fn = reward_fn
        self.name = name
        self._is_async = _is_async(reward_fn)

    @classmethod
    def from_config(cls, reward_spec: str | None, task: Task, rewards: list[Any] | None = None) -> Rewarder:
        """``data.rewards`` (a weighted sum) or ``data.reward`` when set, else the task's own reward.

        Raises:
            ConfigError: a reward name is neither built in nor importable, or the task has no reward of its
                own (a dataset) and none is set.
        """
        if rewards:
            parts = []
            for index, part in enumerate(rewards):
                name = part.fn.rsplit(":", 1)[-1]
                if any(name == taken for taken, _, _ in parts):
                    name = f"{name}_{index}"  # each part logged on its own, even one named twice
                parts.append((name, resolve_reward(part.fn, f"data.rewards[{index}].fn"), part.weight))
            return cls(WeightedReward(parts), name="data.rewards")
        if reward_spec is None:
            if getattr(task, "name", None) == "dataset":
                raise ConfigError(
                    "data.path is set but no reward is: set data.reward (built-in: case, exact, math; or "
                    "'package.module:function') or data.rewards = [{fn = ..., weight = ...}]"
                )
            return cls(task.reward, name=f"data.task {getattr(task, 'name', '?')!r}")
        return cls(resolve_reward(reward_spec, "data.reward"), name=reward_spec)

    async def score(self, samples: list[Sample], item: TaskItem) -> dict[str, float]:
        """Set ``reward`` on each sample in place; failures set ``masked`` and ``mask_reason``. Returns the
        group's metrics: per part of a weighted reward, the sum of its values and the samples it scored."""
        if self._is_async:
            results: list[Any] = [None] * len(samples)

            async def score_one(position: int, sample: Sample) -> None:
                try:
                    results[position] = await self.reward_fn(sample.completion_text, item)
                except Exception as error:
                    results[position] = error

            async with anyio.create_task_group() as tg:
                for position, sample in enumerate(samples):
                    tg.start_soon(score_one, position, sample)
        else:
            results = await anyio.to_thread.run_sync(self._score_sync, samples, item)
        metrics: dict[str, float] = {}
        for sample, result in zip(samples, results, strict=True):
            if isinstance(result, tuple):  # a weighted reward: (total, values of the parts)
                result, parts = result
                for name, value in parts.items():
                    metrics[REWARD_SUM + name] = metrics.get(REWARD_SUM + name, 0.0) + value
                    metrics[REWARD_COUNT + name] = metrics.get(REWARD_COUNT + name, 0.0) + 1
            self._apply(sample, result, item)
        return metrics

    def _score_sync(self, samples: list[Sample], item: TaskItem) -> list[Any]:
        results: list[Any] = []
        for sample in samples:
            try:
                results.append(self.reward_fn(sample.completion_text, item))
            except Exception as error:
                results.append(error)
        return results

    def _apply(self, sample: Sample, result: Any, item: TaskItem) -> None:
        if isinstance(result, Exception):
            problem = f"{type(result).__name__}: {result}"
        elif isinstance(result, bool) or not isinstance(result, int | float):
            problem = f"returned {type(result).__name__}, expected a float"
        elif not math.isfinite(result):
            problem = f"returned non-finite {result}"
        else:
            sample.reward = float(result)
            return
        log.warning(
            "reward failed; sample masked",
            reward=self.name,
            row=item.metadata.get("row"),
            prompt_index=sample.prompt_index,
            sample_index=sample.sample_index,
            problem=problem,
        )
        sample.reward = 0.0
        sample.masked = True
        sample.mask_reason = REWARD_ERROR
