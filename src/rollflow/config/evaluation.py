"""``[eval]``: held-out evaluation on the run's engines."""

from __future__ import annotations

from typing import Any

from rollflow.config.base import NonNegative, NonNegativeFloat, Positive, Section


class EvalConfig(Section):
    """Held-out evaluation on the run's engines: before training, every ``every`` steps and after the last
    step (``eval/*`` metrics); ``rollflow eval CONFIG --checkpoint RUN`` does the same offline."""

    path: str | None = None
    """Held-out dataset (same forms and keys as ``data.path``); unset: ``data.path`` with ``split``, or for a
    generated task (``data.task``) its prompt stream under ``seed``."""
    split: str | None = None
    """Split of ``path`` (or of ``data.path`` when ``path`` is unset), e.g. ``test``."""
    seed: int | None = None
    """Generated tasks: the seed of the held-out prompt stream (unset: ``data.seed + 1``)."""
    num_prompts: Positive = 64
    """Prompts evaluated: the first N of the held-out set, in file order."""
    every: NonNegative = 0
    """Evaluate every N steps (0: only before training and after the last step)."""
    greedy: bool = True
    """One greedy completion per prompt: ``eval/greedy/reward_mean`` and ``eval/greedy/accuracy``."""
    samples: NonNegative = 0
    """Sampled completions per prompt (0: none): ``eval/sampled/reward_mean``, ``eval/sampled/pass@1`` and
    ``eval/sampled/pass@k`` with k = ``samples``."""
    temperature: NonNegativeFloat | None = None
    """Temperature of the sampled completions (unset: ``sampling.temperature``)."""
    max_tokens: Positive | None = None
    """Completion budget (unset: ``sampling.max_tokens``)."""
    pass_threshold: float = 1.0
    """A completion counts as correct (accuracy, pass@k) when its reward is at least this."""
    env_args: dict[str, Any] | None = None
    """With ``[env]`` (verifiers): the held-out environment's arguments, merged key by key over
    ``env.args`` (e.g. ``[eval.env_args.taskset] split = "test"`` picks another split of a taskset whose
    config has a ``split`` field); its first ``num_prompts`` tasks are evaluated. Unset: the same
    environment's tasks after the training ones (``env.num_tasks`` of them train, the next ``num_prompts``
    are evaluated; for OpenEnv, the resets with the seeds after the training ones)."""
