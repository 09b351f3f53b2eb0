"""Built-in verifiable tasks with generated data (no downloads).

A task is random-access: ``item(index)`` always returns the same prompt for the same seed and index, so the
data position of a run is one integer and resuming never repeats or skips a prompt.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from rollflow.errors import CallbackTimeoutError, ConfigError
from rollflow.imports import import_object
from rollflow.rollout.callbacks import CallbackRunner, mark_inline


class TaskItem(msgspec.Struct, frozen=True):
    """One prompt of a task and what its reward needs to judge a completion."""

    messages: list[dict[str, Any]]
    answer: Any = None
    metadata: dict[str, Any] = {}


@runtime_checkable
class Task(Protocol):
    """A stream of prompts and the reward that judges completions to them."""

    name: str

    def item(self, index: int) -> TaskItem:
        """The prompt at position ``index`` of the stream (deterministic)."""
        ...

    def reward(self, completion: str, item: TaskItem) -> float:
        """Score a completion; may also be ``async def``."""
        ...


SUBJECTS = [
    "name a fruit",
    "name an animal",
    "name a color",
    "say a word",
    "name a city",
    "tell a story",
    "give a number word",
    "name a tree",
    "write a greeting",
    "name a planet",
]


class CaseTask:
    """Answer in the letter case the prompt asks for (UPPERCASE or lowercase).

    The reward is the fraction of letters in the requested case (0 when the completion has no letters), so
    a policy that ignores the prompt and always writes one case scores about 0.5: to score near 1 the
    model has to read which case was asked for.
    """

    name = "case"
    inline_item = True  # item() is cheap and never blocks: called on the event loop (see item_caller)

    def __init__(self, seed: int = 0):
        self.seed = seed

    def item(self, index: int) -> TaskItem:
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        case = rng.choice(["upper", "lower"])
        subject = rng.choice(SUBJECTS)
        instruction = "Reply in UPPERCASE" if case == "upper" else "reply in lowercase"
        return TaskItem(
            messages=[{"role": "user", "content": f"{instruction}: {subject}."}],
            answer=case,
        )

    @mark_inline  # string work that never blocks: scored on the loop (rollflow.rollout.callbacks)
    def reward(self, completion: str, item: TaskItem) -> float:
        return case_fraction(completion, item.answer)


def case_fraction(completion: str, case: str) -> float:
    """The fraction of the completion's letters in ``case`` (``upper`` or ``lower``); 0 without letters."""
    letters = [char for char in completion if char.isalpha()]
    if not letters:
        return 0.0
    wanted = str.isupper if case == "upper" else str.islower
    return sum(1 for char in letters if wanted(char)) / len(letters)


class DigitTask:
    """Include a digit in the reply: learnable from scratch in seconds; a smoke test, not prompt-dependent."""

    name = "digit"
    inline_item = True

    def __init__(self, seed: int = 0):
        self.seed = seed

    def item(self, index: int) -> TaskItem:
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        return TaskItem(messages=[{"role": "user", "content": f"Write a number: {rng.choice(SUBJECTS)}."}])

    @mark_inline
    def reward(self, completion: str, item: TaskItem) -> float:
        return 1.0 if any(char.isdigit() for char in completion) else 0.0


BUILTIN_TASKS: dict[str, Callable[[int], Task]] = {"case": CaseTask, "digit": DigitTask}


def load_task(spec: str, seed: int, args: dict[str, Any] | None = None) -> Task:
    """Build the task named by ``data.task``: a built-in name or ``package.module:factory``, called as
    ``factory(seed, **args)`` with the ``[data.args]`` table (``factory(seed)`` without one).

    Raises:
        ConfigError: the name is unknown, the import fails, or the object is not a Task.
    """
    if spec in BUILTIN_TASKS:
        if args:
            raise ConfigError(
                f"[data.args] is passed to custom task factories; the built-in task {spec!r} takes none "
                f"(got {', '.join(sorted(args))})"
            )
        return BUILTIN_TASKS[spec](seed)
    if ":" not in spec:
        raise ConfigError(
            f"data.task = {spec!r} is not a built-in task ({', '.join(sorted(BUILTIN_TASKS))}) "
            "nor an import path of the form 'package.module:factory'"
        )
    factory = import_object(spec, key="data.task")
    try:
        task = factory(seed, **args) if args else factory(seed)
    except Exception as error:
        with_args = f" and [data.args] ({', '.join(sorted(args))})" if args else ""
        raise ConfigError(
            f"data.task = {spec!r}: calling it with the seed{with_args} failed ({type(error).__name__}: "
            f"{error}); a task factory takes the data seed (and the [data.args] keys) and returns a Task"
        ) from error
    if not isinstance(task, Task):
        raise ConfigError(
            f"data.task = {spec!r} returned {type(task).__name__}, which lacks the Task methods "
            "item(index) and reward(completion, item) or the attribute name"
        )
    return task


def item_caller(task: Any, timeout_s: float) -> Callable[[int], Awaitable[TaskItem]]:
    """``await call(index)`` returns ``task.item(index)``.

    A task whose class sets ``inline_item = True`` (the built-in tasks, datasets: lookups that never block)
    is called on the event loop. Any other task's ``item`` is user code: it runs in a worker thread (or, if it
    is ``async def``, on the loop) under ``timeout_s`` (``data.task_timeout_s``), so one that blocks fails
    the run with ``CallbackTimeoutError`` naming the task and the index instead of stalling it, and never
    holds up Ctrl-C or SIGTERM (``rollflow.rollout.callbacks``).
    """
    if getattr(type(task), "inline_item", False):

        async def inline(index: int) -> TaskItem:
            return task.item(index)

        return inline
    name = getattr(task, "name", type(task).__name__)
    runner = CallbackRunner(
        task.item, name=f"data.task {name!r}: item()", timeout_s=timeout_s, timeout_key="data.task_timeout_s"
    )

    async def timed(index: int) -> TaskItem:
        try:
            return await runner(index)
        except CallbackTimeoutError:
            raise CallbackTimeoutError(
                f"data.task {name!r}: item({index}) ran past data.task_timeout_s = {timeout_s:g} s; make it "
                "return promptly (load or generate its data up front), or raise data.task_timeout_s",
                timeout_s=timeout_s,
            ) from None

    return timed
