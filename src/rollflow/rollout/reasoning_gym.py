"""reasoning-gym tasks as data: ``data.path = "reasoning-gym:NAME"`` (``pip install 'rollflow[envs]'``).

The dataset is ``reasoning_gym.create_dataset(NAME, seed=data.seed, size=..., **config)`` with ``size`` and
the task's own configuration from ``[data.args]`` (``size`` defaults to 1000). Every entry is generated once,
up front, so ``item(index)`` is a lookup (position ``i`` is entry ``i % size``). The reward is the task's own
scorer, ``dataset.score_answer(completion, entry)``, unless ``data.reward`` or ``data.rewards`` is set.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollflow.errors import ConfigError, MissingExtraError
from rollflow.rollout.tasks import TaskItem

PREFIX = "reasoning-gym:"
DEFAULT_SIZE = 1000


class ReasoningGymTask:
    """A reasoning-gym dataset as a rollflow ``Task`` (see the module docstring).

    Raises:
        MissingExtraError: reasoning-gym is not installed.
        ConfigError: an unknown task name, or a configuration the task refuses.
    """

    inline_item = True  # entries are generated in __init__: item() is a list lookup

    def __init__(self, name: str, *, seed: int = 0, size: int = DEFAULT_SIZE, **config: Any):
        try:
            reasoning_gym = importlib.import_module("reasoning_gym")
        except ImportError as error:
            raise MissingExtraError(
                f"data.path = '{PREFIX}{name}' needs reasoning-gym: pip install 'rollflow[envs]' ({error})"
            ) from None
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = sorted(known for known in DATASETS if name[:3] in known)[:8]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise ConfigError(f"data.path = '{PREFIX}{name}': reasoning-gym has no task {name!r}{hint}")
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"data.args.size = {size!r} must be a positive integer (entries generated)")
        try:
            self.dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
            self.entries = [self.dataset[index] for index in range(size)]
        except (TypeError, ValueError, AssertionError) as error:
            raise ConfigError(
                f"data.path = '{PREFIX}{name}': [data.args] {sorted(config)} refused by the task "
                f"({type(error).__name__}: {error})"
            ) from error
        self.name = f"{PREFIX}{name}"
        self.items = [
            TaskItem(
                messages=[{"role": "user", "content": entry["question"]}],
                answer=entry["answer"],
                metadata={"row": index},
            )
            for index, entry in enumerate(self.entries)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def item(self, index: int) -> TaskItem:
        return self.items[index % len(self.items)]

    def reward(self, completion: str, item: TaskItem) -> float:
        """The task's own ``score_answer`` of ``completion`` for the entry ``item`` came from."""
        return float(self.dataset.score_answer(completion, self.entries[item.metadata["row"]]))
