"""Groups for the first N prompts of a task from any generator, in prompt order (``rollflow generate``,
``rollflow eval`` and the run's evaluations use it; ``rollflow.orchestrator.offline`` wires the commands)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from rollflow.config import DataConfig
from rollflow.messages import RolloutRequest, ScoredGroup
from rollflow.rollout.tasks import item_caller


async def generate_groups(
    generator: Any,
    task: Any,
    num_prompts: int,
    *,
    samples_per_prompt: int,
    max_concurrent: int,
    item_timeout_s: float | None = None,
) -> AsyncIterator[ScoredGroup]:
    """Groups for prompts ``0 .. num_prompts - 1``, ``max_concurrent`` at a time, in prompt order; a custom
    task's ``item`` runs under ``item_timeout_s`` (``data.task_timeout_s``; default: its default)."""
    groups: dict[int, ScoredGroup] = {}
    limiter = anyio.CapacityLimiter(max_concurrent)
    timeout_s = DataConfig().task_timeout_s if item_timeout_s is None else item_timeout_s
    item_of = item_caller(task, timeout_s)

    async def one(index: int) -> None:
        async with limiter:
            item = await item_of(index)
            request = RolloutRequest(
                prompt_index=index,
                messages=item.messages,
                answer=item.answer,
                metadata=item.metadata,
                num_samples=samples_per_prompt,
            )
            groups[index] = await generator.generate_group(request)

    async with anyio.create_task_group() as tg:
        for index in range(num_prompts):
            tg.start_soon(one, index)
    for index in range(num_prompts):
        yield groups[index]
