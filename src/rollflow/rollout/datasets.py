"""Prompts read from a dataset: JSONL, parquet, a directory saved with HF ``datasets``, or ``hf:NAME`` from the
local HF datasets cache.

Rows are read once into memory as plain dicts. ``DatasetTask`` maps the run's ever-growing data position to a
row: position ``i`` is row ``order[epoch][i % n]`` of epoch ``i // n``, where each epoch's order is a fixed
shuffle seeded by ``data.seed`` and the epoch. The data position and ``trained_ahead`` of a checkpoint
(``orchestrator/checkpoint.py``) thereby make a resume train every row exactly once per epoch.

Prompt formats read without conversion: a list of chat messages (TRL's conversational format, verl's
``prompt`` column) or a string (wrapped as one user message). The answer is ``data.answer_key`` (a dotted path
into nested columns), by default ``answer`` or verl's ``reward_model.ground_truth``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from rollflow.errors import ConfigError
from rollflow.rollout.tasks import TaskItem

log = structlog.get_logger(__name__)

DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
"""Answer columns tried, in order, when ``data.answer_key`` is unset."""

_MISSING = object()


class Rows(list):  # type: ignore[type-arg]
    """The rows of a dataset (plain dicts, a list like any other) and, read from JSONL, the file line of each.

    Messages about a row name it the same way everywhere: ``line L, row R`` for JSONL (``L`` counts from 1
    as editors do, blank lines included; ``R`` is its index among the rows, from 0), ``row R`` otherwise.
    """

    lines: list[int] | None = None
    """Per row, its line in the JSONL file (None: not read from JSONL)."""


def row_name(row: int, lines: list[int] | None) -> str:
    """``line L, row R`` (JSONL) or ``row R``: how messages and logs name row ``row``."""
    return f"line {lines[row]}, row {row}" if lines is not None else f"row {row}"


def read_rows(path: str, split: str | None = None, *, key: str = "data.path") -> list[dict[str, Any]]:
    """All rows of the dataset at ``path`` (see the module docstring for the forms it takes); from JSONL, a
    ``Rows`` that also holds each row's line.

    Raises:
        ConfigError: the file or directory does not exist, its format is unknown, a row is not valid
            JSON, the split does not exist, or an optional reader (``datasets``) is not installed.
    """
    if path.startswith("hf:"):
        return _read_hf_cache(path[3:], split, key)
    source = Path(path).expanduser()
    if not source.exists():
        raise ConfigError(f"{key} = {path!r}: no such file or directory")
    if source.is_dir():
        return _read_directory(source, split, key)
    if split is not None:
        raise ConfigError(
            f"data.split = {split!r} applies to a directory (holding {split}.jsonl or {split}.parquet, or "
            f"saved with datasets), but {key} = {path!r} is one file: drop data.split or point {key} at "
            "the directory"
        )
    return _read_file(source, key)


def _read_file(source: Path, key: str) -> list[dict[str, Any]]:
    suffix = source.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(source, key)
    if suffix == ".parquet":
        return _read_parquet(source, key)
    raise ConfigError(
        f"{key} = {str(source)!r}: unknown data format {suffix or '(no suffix)'!r}; rollflow reads .jsonl, "
        ".parquet, a directory saved with datasets' save_to_disk, or hf:NAME"
    )


def _read_jsonl(source: Path, key: str) -> Rows:
    rows = Rows()
    lines: list[int] = []
    with source.open("rb") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"line {line_number}, row {len(rows)}"
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"{key} = {str(source)!r}, {where}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{key} = {str(source)!r}, {where}: a row must be a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
            lines.append(line_number)
    rows.lines = lines
    return rows


def _read_parquet(source: Path, key: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{key} = {str(source)!r}: reading parquet needs pyarrow: pip install pyarrow"
        ) from None
    try:
        return pq.read_table(source).to_pylist()
    except Exception as error:  # pyarrow raises several types for a corrupt file
        raise ConfigError(f"{key} = {str(source)!r}: not a readable parquet file ({error})") from None


def _read_directory(source: Path, split: str | None, key: str) -> list[dict[str, Any]]:
    if (source / "dataset_dict.json").exists() or (source / "dataset_info.json").exists():
        return _read_saved_dataset(source, split, key)
    name = split or "train"
    for suffix in (".jsonl", ".parquet", ".json"):
        candidate = source / f"{name}{suffix}"
        if candidate.exists():
            return _read_file(candidate, key)
    present = sorted(path.name for path in source.iterdir())
    raise ConfigError(
        f"{key} = {str(source)!r} (data.split = {name!r}): the directory holds neither {name}.jsonl nor "
        f"{name}.parquet nor a dataset saved with datasets' save_to_disk; it holds: {', '.join(present) or 'nothing'}"
    )


def _import_datasets(key: str, value: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{key} = {value!r} needs the HF datasets library: pip install datasets (or 'rollflow[data]')"
        ) from None
    return datasets


def _pick_split(dataset: Any, split: str | None, key: str, value: str) -> Any:
    if not hasattr(dataset, "keys"):  # a single Dataset
        return dataset
    splits = list(dataset.keys())
    name = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
    if name not in splits:
        raise ConfigError(f"data.split = {split!r} for {key} = {value!r}: the splits are {', '.join(splits)}")
    return dataset[name]


def _read_saved_dataset(source: Path, split: str | None, key: str) -> list[dict[str, Any]]:
    datasets = _import_datasets(key, str(source))
    dataset = _pick_split(datasets.load_from_disk(str(source)), split, key, str(source))
    return dataset.to_list()


def _read_hf_cache(name: str, split: str | None, key: str) -> list[dict[str, Any]]:
    import os

    # The local cache only, no download behind the user's back (read when datasets is first imported).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = _import_datasets(key, f"hf:{name}")
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as error:
        raise ConfigError(
            f"{key} = 'hf:{name}' is not in the local HF datasets cache ({type(error).__name__}: {error}); "
            f"download it first (datasets.load_dataset({name!r}) with network), or point {key} at a file"
        ) from None
    return _pick_split(dataset, split, key, f"hf:{name}").to_list()


def lookup(row: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``a.b.c``) in nested dicts; ``_MISSING`` when a part is absent."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Dotted column names of the first row (nested dicts expanded), for error messages."""
    for row in rows:
        return _dotted_names(row, "")
    return []


def _dotted_names(value: dict[str, Any], prefix: str) -> list[str]:
    names = []
    for name, inner in value.items():
        names.append(prefix + name)
        if isinstance(inner, dict):
            names += _dotted_names(inner, f"{prefix}{name}.")
    return names


def to_messages(prompt: Any) -> list[dict[str, Any]] | None:
    """Chat messages from a prompt value: a string becomes one user message; a list of ``{role, content}``
    dicts is taken as is. None when the value is neither."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, list | tuple)
        and prompt
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
    ):
        return [dict(message) for message in prompt]
    return None


class DatasetTask:
    """A task over the rows of a dataset, shuffled per epoch; its reward is set by ``data.reward(s)``."""

    name = "dataset"
    inline_item = True  # a lookup: called on the event loop (rollflow.rollout.tasks.item_caller)

    def __init__(
        self,
        rows: list[dict[str, Any]],
        *,
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        on_bad_row: str = "fail",
        source: str = "data",
        key: str = "data",
        lines: list[int] | None = None,
    ):
        """Args (besides the ``data.*`` keys they mirror):
        rows: the rows (``read_rows``).
        source: the dataset's path, for messages.
        key: the config section (``data``, ``eval``), for messages.
        lines: per row, its JSONL line (default: ``rows.lines`` of a ``Rows``); items carry it in their
            metadata (``line``, next to ``row``) and messages name rows by it (``row_name``).

        Raises:
            ConfigError: no rows, a key absent from every row (the message lists the columns), or a row without
                a usable prompt or answer while ``on_bad_row = "fail"`` (the message names the row).
        """
        self.source = source
        self.key = key
        self.lines = lines if lines is not None else getattr(rows, "lines", None)
        if not rows:
            raise ConfigError(
                f"{key}.path = {source!r}: the dataset (split) is empty; there is nothing to train on"
            )
        present = columns(rows)
        if lookup(rows[0], prompt_key) is _MISSING and all(lookup(r, prompt_key) is _MISSING for r in rows):
            raise ConfigError(
                f"{key}.prompt_key = {prompt_key!r}: no such column in {source!r}; its columns are: "
                f"{', '.join(present)}"
            )
        if answer_key is None:
            answer_key = next((k for k in DEFAULT_ANSWER_KEYS if lookup(rows[0], k) is not _MISSING), None)
        elif all(lookup(r, answer_key) is _MISSING for r in rows):
            raise ConfigError(
                f"{key}.answer_key = {answer_key!r}: no such column in {source!r}; its columns are: "
                f"{', '.join(present)}"
            )
        self.items: list[TaskItem] = []
        self.rows: list[int] = []  # the source row of each item
        bad: list[str] = []
        for number, row in enumerate(rows):
            messages = to_messages(lookup(row, prompt_key))
            answer = None if answer_key is None else lookup(row, answer_key)
            problem = None
            if messages is None:
                problem = (
                    f"{prompt_key!r} is missing or neither a string nor a list of {{role, content}} messages"
                )
            elif answer is _MISSING:
                problem = f"{answer_key!r} is missing"
            if problem is not None:
                if on_bad_row == "fail":
                    raise ConfigError(
                        f"{source!r}, {row_name(number, self.lines)}: {problem}; fix the row, or set "
                        f"{key}.on_bad_row = 'skip' to count and skip such rows"
                    )
                bad.append(f"{row_name(number, self.lines)}: {problem}")
                continue
            metadata: dict[str, Any] = {"row": number}
            if self.lines is not None:
                metadata["line"] = self.lines[number]
            self.items.append(TaskItem(messages=messages, answer=answer, metadata=metadata))
            self.rows.append(number)
        self.skipped = len(bad)
        if bad:
            log.warning(
                "skipped bad rows", source=source, skipped=len(bad), kept=len(self.items), first=bad[:3]
            )
        if not self.items:
            raise ConfigError(f"{source!r}: every one of its {len(rows)} rows is bad ({bad[0]})")
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.items)

    def order(self, epoch: int) -> list[int]:
        """Item positions in the order epoch ``epoch`` visits them (a fixed shuffle per seed and epoch)."""
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(f"data:{self.seed}:{epoch}").shuffle(order)
            if len(self._orders) > 2:  # a run reads about one epoch at a time (two where they meet)
                self._orders.clear()
            self._orders[epoch] = order
        return self._orders[epoch]

    def item(self, index: int) -> TaskItem:
        epoch, offset = divmod(index, len(self.items))
        item = self.items[self.order(epoch)[offset]]
        return TaskItem(
            messages=item.messages, answer=item.answer, metadata={**item.metadata, "epoch": epoch}
        )

    def reward(self, completion: str, item: TaskItem) -> float:
        raise ConfigError("a dataset has no reward of its own: set data.reward or data.rewards")

    def describe(self, metadata: dict[str, Any]) -> str:
        """How messages name the row an item came from: ``data.path = 'x.jsonl', line 11, row 10``."""
        row = metadata.get("row")
        if not isinstance(row, int):
            return f"{self.key}.path = {self.source!r}"
        return f"{self.key}.path = {self.source!r}, {row_name(row, self.lines)}"


REASONING_GYM = "reasoning-gym:"
"""``data.path`` prefix of a reasoning-gym task (``rollflow.rollout.reasoning_gym``)."""


def task_from_config(
    data: Any, *, path: str | None = None, split: str | None = None, key: str = "data"
) -> Any:
    """The run's task: a ``DatasetTask`` over ``data.path`` (or ``path``), a ``ReasoningGymTask`` for
    ``reasoning-gym:NAME`` (``[data.args]``: its size and configuration), else ``data.task``.

    Raises:
        ConfigError: see ``read_rows``, ``DatasetTask`` and ``rollflow.rollout.tasks.load_task``.
    """
    from rollflow.rollout.tasks import load_task

    source = path if path is not None else data.path
    if source is None:
        return load_task(data.task, data.seed, data.args)
    if source.startswith(REASONING_GYM):
        from rollflow.rollout.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(source.removeprefix(REASONING_GYM), seed=data.seed, **data.args)
    rows = read_rows(source, split if path is not None else data.split, key=f"{key}.path")
    return DatasetTask(
        rows,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        seed=data.seed,
        shuffle=data.shuffle,
        on_bad_row=data.on_bad_row,
        source=source,
        key=key,
    )


def steps_for_epochs(epochs: int, num_rows: int, prompts_per_step: int) -> int:
    """Optimizer steps that train ``epochs`` passes over ``num_rows`` rows (the last step is topped up from
    the next epoch's order when they do not divide evenly)."""
    return -(-epochs * num_rows // prompts_per_step)
