"""Scoring completions: the task's reward or a user function named by import path.

A reward function is ``fn(completion: str, item: TaskItem) -> float``, sync or async. Sync functions run in a
worker thread (one hop per group), so a slow reward never stalls generation. A function that raises or
returns a non-finite number masks that one sample; the run goes on and the error is counted.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from rollflow.imports import import_object
from rollflow.messages import Sample
from rollflow.rollout.tasks import Task, TaskItem

log = structlog.get_logger(__name__)

RewardFn = Callable[[str, TaskItem], float | Awaitable[float]]

REWARD_ERROR = "reward_error"


class Rewarder:
    """Assigns rewards to the samples of one group, masking samples whose reward fails."""

    def __init__(self, reward_fn: RewardFn):
        self.reward_fn = reward_fn
        self._is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
            getattr(reward_fn, "__call__", None)  # noqa: B004 - async callable objects
        )

    @classmethod
    def from_config(cls, reward_spec: str | None, task: Task) -> Rewarder:
        """``data.reward`` when set, else the task's own reward."""
        if reward_spec is None:
            return cls(task.reward)
        return cls(import_object(reward_spec, key="data.reward"))

    async def score(self, samples: list[Sample], item: TaskItem) -> None:
        """Set ``reward`` on each sample in place; failures set ``masked`` and ``mask_reason``."""
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
        for sample, result in zip(samples, results, strict=True):
            self._apply(sample, result)

    def _score_sync(self, samples: list[Sample], item: TaskItem) -> list[Any]:
        results: list[Any] = []
        for sample in samples:
            try:
                results.append(self.reward_fn(sample.completion_text, item))
            except Exception as error:
                results.append(error)
        return results

    def _apply(self, sample: Sample, result: Any) -> None:
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
            prompt_index=sample.prompt_index,
            sample_index=sample.sample_index,
            problem=problem,
        )
        sample.reward = 0.0
        sample.masked = True
        sample.mask_reason = REWARD_ERROR
