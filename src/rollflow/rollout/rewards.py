"""Scoring completions: the task's reward, a built-in one (``math``, ``exact``, ``case``), a user function named
by import path, or a weighted sum of these (``data.rewards``).

A reward function is ``fn(completion: str, item: TaskItem) -> float``, sync or async, and each sample's call
runs under ``data.reward_timeout_s``: sync functions in worker threads that a timeout or a stop abandons
(``rollflow.rollout.callbacks``), so a slow reward never stalls generation and a blocked one never holds the
run up at Ctrl-C or SIGTERM. Its value
is held to one contract (``reward_value``: a real number, finite in float32). A function that raises, returns
anything else, or runs past its timeout masks that one sample (scored 0, left out of the loss and its group's
baseline); the run goes on, the failure is counted (``reward_errors``, ``reward_timeouts``) and logged with the
reward's name and the prompt's row (and line, for JSONL). With ``data.rewards`` each part is also logged on its
own: ``reward/NAME`` is its mean over the step's samples it scored.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import anyio
import structlog

from rollflow.config import DataConfig
from rollflow.errors import CallbackTimeoutError, ConfigError, RewardPartError, StuckCallbacksError
from rollflow.imports import import_object
from rollflow.messages import Sample
from rollflow.rollout.callbacks import CallbackRunner, is_interruption
from rollflow.rollout.tasks import Task, TaskItem

log = structlog.get_logger(__name__)

RewardFn = Callable[[str, TaskItem], float | Awaitable[float]]

REWARD_ERROR = "reward_error"
"""``mask_reason`` of a sample whose reward raised or returned a value ``reward_value`` refuses."""
REWARD_TIMEOUT = "reward_timeout"
"""``mask_reason`` of a sample whose reward ran past ``data.reward_timeout_s``."""


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


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: rewards beyond it would overflow the trainer's float32 advantages and loss."""


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (an int of 5,000 digits has no repr at all)."""
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def reward_value(value: Any) -> float:
    """A reward function's return value as the float the sample gets: the one contract of every reward
    (``data.reward``, each part of ``data.rewards``, a task's reward, an agent's).

    Accepted: any real number (``numbers.Real``: ``int``, ``float``, ``fractions.Fraction``, numpy's
    integer and floating scalars) and a 0-d array or tensor (numpy, torch, jax: anything with ``ndim == 0``
    and ``.item()``) holding one, converted with ``float()``, whose value is finite in float32
    (``|reward| <= FLOAT32_MAX``): the trainer's advantages and loss are float32, and float64 sums of such
    rewards cannot overflow. Refused: everything else, ``bool`` included (rollflow never reads a bool as a
    number; return ``float(ok)`` for a 0/1 reward), integers too large for a float, NaN and infinities.

    Raises:
        ValueError: the problem, in words (``returned str, expected a real number``).
    """
    if type(value) is not float and type(value) is not int:
        original = type(value).__name__
        if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0:
            item = getattr(value, "item", None)
            if callable(item):
                try:
                    value = item()
                except Exception as error:
                    raise ValueError(f"returned a 0-d {original} whose .item() failed ({error})") from None
        if isinstance(value, bool):
            raise ValueError(
                f"returned {original}, expected a real number; return float(...) for a 0/1 reward"
            )
        if not isinstance(value, numbers.Real):
            raise ValueError(f"returned {original}, expected a real number (e.g. a float)")
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError) as error:
        raise ValueError(f"returned {_short(value)}, which has no float value ({error})") from None
    if not -FLOAT32_MAX <= number <= FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(
            f"returned {number!r}: a reward must be finite in float32 (|reward| <= {FLOAT32_MAX:.4g})"
        )
    return number


class WeightedReward:
    """``sum(weight * fn(completion, item))`` over named parts, each value held to ``reward_value``'s
    contract; returns the sum and the parts' values (for the group's ``reward/NAME`` metrics).

    Sync parts run in worker threads (``rollflow.rollout.callbacks``); the ``Rewarder``'s timeout covers the
    whole sum."""

    def __init__(self, parts: list[tuple[str, RewardFn, float]]):
        self.parts = parts
        self._runners = [
            CallbackRunner(
                fn, name=f"reward {name!r}", timeout_s=math.inf, timeout_key="data.reward_timeout_s"
            )
            for name, fn, _ in parts
        ]

    async def __call__(self, completion: str, item: TaskItem) -> tuple[float, dict[str, float]]:
        values: dict[str, float] = {}
        total = 0.0
        for (name, _, weight), runner in zip(self.parts, self._runners, strict=True):
            try:
                value = reward_value(await runner(completion, item))
            except StuckCallbacksError:
                raise
            except BaseException as error:
                if is_interruption(error):
                    raise
                raise RewardPartError(name, error) from error
            values[name] = value
            total += weight * value
        return total, values


class _Failure(NamedTuple):
    reason: str  # the sample's mask_reason
    problem: str


class Rewarder:
    """Assigns rewards to the samples of one group, masking samples whose reward fails or times out.

    Each sample's reward is one call of ``reward_fn`` under ``timeout_s`` (``data.reward_timeout_s``): an
    async function on the event loop, a sync one in a worker thread that is abandoned past the timeout or at
    a stop, so that a reward that blocks costs its sample (masked ``reward_timeout``), never the run, and
    Ctrl-C or SIGTERM stop the run at once even while one blocks (``rollflow.rollout.callbacks`` says how,
    and why not processes). A reward that raises (any exception, ``SystemExit`` included; Ctrl-C and
    cancellation stop the run instead) or returns something ``reward_value`` refuses masks its sample as
    ``reward_error``.
    """

    def __init__(self, reward_fn: RewardFn, name: str = "reward", *, timeout_s: float | None = None):
        """Args:
        reward_fn: ``fn(completion, item) -> float``, sync or async (or a ``WeightedReward``).
        name: how logs and errors name it (``data.reward``'s value).
        timeout_s: longest one sample's reward may take, in seconds (default: ``data.reward_timeout_s``'s).
        """
        self.reward_fn = reward_fn
        self.name = name
        self.timeout_s = DataConfig().reward_timeout_s if timeout_s is None else timeout_s
        self.runner = CallbackRunner(
            reward_fn, name=f"reward {name!r}", timeout_s=self.timeout_s, timeout_key="data.reward_timeout_s"
        )
        self._weighted = isinstance(reward_fn, WeightedReward)
        # The last problem that masked a sample, for the error of a run that trains on nothing.
        self.last_problem: str | None = None

    @classmethod
    def from_config(
        cls,
        reward_spec: str | None,
        task: Task,
        rewards: list[Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Rewarder:
        """``data.rewards`` (a weighted sum) or ``data.reward`` when set, else the task's own reward;
        ``timeout_s`` is ``data.reward_timeout_s``.

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
            return cls(WeightedReward(parts), name="data.rewards", timeout_s=timeout_s)
        if reward_spec is None:
            if getattr(task, "name", None) == "dataset":
                raise ConfigError(
                    "data.path is set but no reward is: set data.reward (built-in: case, exact, math; or "
                    "'package.module:function') or data.rewards = [{fn = ..., weight = ...}]"
                )
            return cls(task.reward, name=f"data.task {getattr(task, 'name', '?')!r}", timeout_s=timeout_s)
        return cls(resolve_reward(reward_spec, "data.reward"), name=reward_spec, timeout_s=timeout_s)

    async def score(self, samples: list[Sample], item: TaskItem) -> dict[str, float]:
        """Set ``reward`` on each sample in place; failures set ``masked`` and ``mask_reason``
        (``reward_error``, ``reward_timeout``). Returns the group's metrics: per part of a weighted reward,
        the sum of its values and the samples it scored.

        Raises:
            StuckCallbacksError: too many calls of a sync reward are still running past their timeout.
        """
        results: list[Any] = [None] * len(samples)

        async def score_one(position: int, sample: Sample) -> None:
            results[position] = await self._outcome(sample.completion_text, item)

        if len(samples) == 1 or self.runner.inline:  # an inline reward returns at once: no task per sample
            for position, sample in enumerate(samples):
                await score_one(position, sample)
        else:
            async with anyio.create_task_group() as tg:
                for position, sample in enumerate(samples):
                    tg.start_soon(score_one, position, sample)
        metrics: dict[str, float] = {}
        for sample, result in zip(samples, results, strict=True):
            self._apply(sample, result, item, metrics)
        return metrics

    async def _outcome(self, completion: str, item: TaskItem) -> Any:
        """What the reward returned, or the ``_Failure`` that masks the sample."""
        try:
            return await self.runner(completion, item)
        except CallbackTimeoutError as error:
            return _Failure(REWARD_TIMEOUT, str(error))
        except StuckCallbacksError:
            raise
        except BaseException as error:
            if is_interruption(error):
                raise
            return _Failure(REWARD_ERROR, f"{type(error).__name__}: {error}")

    def _apply(self, sample: Sample, result: Any, item: TaskItem, metrics: dict[str, float]) -> None:
        if isinstance(result, _Failure):
            failure = result
        else:
            parts: dict[str, float] = {}
            if self._weighted:
                result, parts = result
            try:
                sample.reward = reward_value(result)
            except ValueError as error:
                failure = _Failure(REWARD_ERROR, str(error))
            else:
                for name, value in parts.items():
                    metrics[REWARD_SUM + name] = metrics.get(REWARD_SUM + name, 0.0) + value
                    metrics[REWARD_COUNT + name] = metrics.get(REWARD_COUNT + name, 0.0) + 1
                return
        self.last_problem = failure.problem
        log.warning(
            "reward failed; sample masked",
            reward=self.name,
            row=item.metadata.get("row"),
            **({"line": item.metadata["line"]} if "line" in item.metadata else {}),
            prompt_index=sample.prompt_index,
            sample_index=sample.sample_index,
            reason=failure.reason,
            problem=failure.problem,
        )
        sample.reward = 0.0
        sample.masked = True
        sample.mask_reason = failure.reason
