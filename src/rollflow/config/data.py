"""``[data]``: the prompts (a generated task or a dataset) and their rewards."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from rollflow.config.base import Positive, PositiveFloat, Section
from rollflow.messages import sampling_error

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class RewardSpec(Section):
    fn: str
    """A built-in reward (``math``, ``exact``, ``case``) or ``package.module:function``."""
    weight: float = 1.0
    """Its weight in the sum that is the sample's reward."""


class DataConfig(Section):
    task: str = "case"
    """Built-in task (``case``, ``digit``) or ``package.module:factory`` returning a Task; unused with ``path``."""
    path: str | None = None
    """Prompts from a dataset instead of ``task``: a ``.jsonl`` or ``.parquet`` file, a directory (holding
    ``{split}.jsonl`` / ``{split}.parquet``, or saved with HF datasets' ``save_to_disk``), or ``hf:NAME`` from
    the local HF datasets cache (needs ``pip install datasets``), or ``reasoning-gym:NAME``, a reasoning-gym
    task (``[data.args]``: ``size`` and its configuration; ``seed``; its own scorer is the reward)."""
    split: str | None = None
    """Split of a directory or ``hf:`` dataset (unset: ``train``); not for a single file."""
    prompt_key: str = "prompt"
    """Column of the prompt, a dotted path into nested columns: a string (one user message) or a list of
    ``{role, content}`` messages (TRL's conversational format, verl's ``prompt``)."""
    answer_key: str | None = None
    """Column of the reference answer the reward gets as ``item.answer`` (dotted path); unset: ``answer``, else
    verl's ``reward_model.ground_truth``, else none."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A row without a usable prompt or answer, or a prompt (of any task) that cannot fit
    ``inference.max_model_len`` with room for one generated token: ``fail`` (an error naming the row, its
    line for JSONL) or ``skip`` (counted and logged, never silent: a prompt too long is not generated for,
    its group's samples are masked as ``prompt_too_long`` and counted in the ``skipped_prompts`` metric).
    Prompts are measured before they are tokenized: text with more characters than ``max_model_len`` times
    the tokenizer's longest token (x4 for Unicode normalization) cannot fit and is never tokenized."""
    shuffle: bool = True
    """Visit the rows of each epoch in a fresh order seeded by ``seed`` and the epoch (False: file order)."""
    epochs: Positive | None = None
    """Passes over a dataset (``path``); sets the run's length to ``ceil(epochs * rows / prompts_per_step)``
    steps, in place of ``orchestrator.steps``. Every row is trained exactly once per epoch, across resumes."""
    args: dict[str, Any] = {}
    """Keyword arguments for a custom task factory (``[data.args]``): ``factory(seed, **args)``; for
    ``reasoning-gym:NAME``, its ``size`` and configuration."""
    reward: str | None = None
    """Reward override: a built-in (``math``, ``exact``, ``case``) or ``package.module:function``, sync or
    async, called as ``fn(completion, item)``. Required with ``path`` unless ``rewards`` is set."""
    rewards: list[RewardSpec] = []
    """A weighted sum of rewards, ``[{fn = "math", weight = 1.0}, ...]``; each is logged as ``reward/NAME``."""
    seed: int = 0
    """Seed of the generated prompt stream (or of a dataset's shuffles); the same seed gives the same prompts in
    the same order."""
    reward_timeout_s: PositiveFloat = 60.0
    """Longest one sample's reward may take (with ``rewards``, the whole weighted sum), in seconds. Past it
    the sample is masked (``reward_timeout``), counted in the ``reward_timeouts`` metric and logged; a sync
    reward's thread is left to finish on its own (the run does not wait for it, nor does ``rollflow``'s
    exit), and 64 such calls still running stop the run with an error naming the reward."""
    task_timeout_s: PositiveFloat = 60.0
    """Longest a custom task's ``item(index)`` may take (it runs in a worker thread), in seconds; past it the
    run fails with an error naming the task and the index. Built-in tasks and datasets are lookups and are
    not timed."""


def data_errors(config: RunConfig) -> list[str]:
    data = config.data
    errors = []
    if data.reward is not None and data.rewards:
        errors.append(
            f"data.reward = {data.reward!r} and data.rewards are both set: use one (data.rewards = "
            "[{fn = ..., weight = ...}] for a weighted sum)"
        )
    for index, part in enumerate(data.rewards):
        if not math.isfinite(part.weight):
            errors.append(f"data.rewards[{index}].weight = {part.weight} must be a finite number")
    if data.epochs is not None and data.path is None:
        errors.append(
            f"data.epochs = {data.epochs} counts passes over a dataset: set data.path, or use "
            "orchestrator.steps for a generated task"
        )
    evaluation = config.eval
    if evaluation is not None:
        if config.agent is not None:
            errors.append("[eval] evaluates single-turn generation; it does not run [agent] rollouts yet")
        if evaluation.path is None and data.path is not None and evaluation.split in (None, data.split):
            errors.append(
                f"[eval] would evaluate the training data (data.path = {data.path!r}, split "
                f"{data.split or 'train'!r}): set eval.path to a held-out file or eval.split to another split"
            )
        if evaluation.env_args is not None and config.env is None:
            errors.append(
                "eval.env_args is for a held-out [env] environment; without [env] use eval.path or eval.split"
            )
        if not evaluation.greedy and evaluation.samples == 0:
            errors.append("[eval] with eval.greedy = false and eval.samples = 0 evaluates nothing: set one")
        if evaluation.max_tokens is not None and evaluation.max_tokens >= config.inference.max_model_len:
            errors.append(
                f"eval.max_tokens ({evaluation.max_tokens}) must be smaller than inference.max_model_len "
                f"({config.inference.max_model_len}) to leave room for the prompt"
            )
        if not math.isfinite(evaluation.pass_threshold):
            errors.append(f"eval.pass_threshold = {evaluation.pass_threshold} must be a finite number")
        if evaluation.temperature is not None and evaluation.temperature == 0 and evaluation.samples > 0:
            errors.append("eval.temperature = 0 makes every sampled completion the greedy one; use > 0")
        temperature = (
            config.sampling.temperature if evaluation.temperature is None else evaluation.temperature
        )
        problem = sampling_error(max_tokens=1, temperature=temperature, top_p=1.0, top_k=-1)
        if problem is not None:
            errors.append(f"eval.{problem[1]}")
    if data.args and data.path is not None and not data.path.startswith("reasoning-gym:"):
        errors.append("[data.args] is for custom task factories (data.task), not for a dataset (data.path)")
    return errors
