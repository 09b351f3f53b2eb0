"""What every environment kind gives the generator: its tasks as a ``Task`` and one rollout per trajectory.

An environment source (``EnvSource``) is entered once per run (``async with``: it may start servers or pools)
and then serves concurrent ``rollout(base_url, task)`` calls: ``base_url`` is the trajectory's TITO session
(an OpenAI-compatible base URL), ``task`` its ``AgentTask`` (``metadata["env_task"]`` is the index of the
environment's task). A rollout reports an ``EnvOutcome``; a failure is an outcome with ``error`` or
``timed_out`` set, never a reward of 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from rollflow.errors import ConfigError
from rollflow.rollout.tasks import TaskItem

if TYPE_CHECKING:
    from rollflow.rollout.agent import AgentTask

#: ``TaskItem.metadata`` key of the environment task's index.
ENV_TASK = "env_task"


class EnvOutcome(msgspec.Struct, frozen=True):
    """One trajectory's result as the environment judged it."""

    reward: float = 0.0
    # Each named reward the environment recorded (logged as ``reward/NAME``), before weighting into ``reward``.
    parts: dict[str, float] = {}
    # Why the environment failed this trajectory (it raised, lost its server); None: it finished.
    error: str | None = None
    # The environment's own deadline ended the trajectory.
    timed_out: bool = False


class EnvSource(Protocol):
    """An environment kind behind one interface (see the module docstring)."""

    task: EnvTasks

    async def __aenter__(self) -> EnvSource: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def rollout(self, base_url: str, task: AgentTask) -> EnvOutcome:
        """Run one trajectory against the model at ``base_url``."""
        ...

    def held_out(self, first: int, count: int) -> EnvTasks:
        """Tasks ``first .. first + count - 1`` of the environment, run by this source (``[eval]``)."""
        ...


class EnvTasks:
    """An environment's tasks as a rollflow ``Task``: position ``i`` of the stream is task ``i % len``, so
    each pass visits every task once in the environment's order. Rewards come from the environment, never
    from ``reward``."""

    inline_item = True  # a list lookup: called on the event loop

    def __init__(self, name: str, items: list[TaskItem], source: Any = None):
        if not items:
            raise ConfigError(f"env.id = {name!r} has no tasks")
        self.name = name
        self.items = items
        # The environment the tasks are of (``open_generator`` builds its generator from it).
        self.source = source

    def __len__(self) -> int:
        return len(self.items)

    def item(self, index: int) -> TaskItem:
        return self.items[index % len(self.items)]

    def reward(self, completion: str, item: TaskItem) -> float:
        raise ConfigError("an [env] task is scored by its environment, not by data.reward")


def prompt_messages(prompt: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Chat messages of an environment's prompt (a string or a list of messages), for the task item that
    logs and measures it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if prompt is None:
        return messages
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    for message in prompt:
        dumped = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        messages.append(dumped)
    return messages
