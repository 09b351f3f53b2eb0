"""Metric sinks (one JSON line per step) and the terminal progress display."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from rollflow.errors import StorageError, describe_os_error

#: Step metrics of the step pipeline (``rollflow.orchestrator.pipeline``), one per stage or channel: seconds
#: a stage waited for its next input, seconds it waited to hand its output on (back-pressure), a channel's
#: unread messages at the step's end and at most during the step; and the fraction of the train-and-barrier
#: time during which generation went on (0 in sync mode). ``rollflow plot`` draws them as one figure.
PIPELINE_WAIT_INPUT = "pipeline/wait_input_s/"
PIPELINE_WAIT_OUTPUT = "pipeline/wait_output_s/"
PIPELINE_DEPTH = "pipeline/depth/"
PIPELINE_DEPTH_MAX = "pipeline/depth_max/"
PIPELINE_OVERLAP = "pipeline/overlap_fraction"
#: The stages in the order a message passes them (the plot's order).
PIPELINE_STAGES = ("prompts", "generation", "batcher", "trainer", "barrier", "admission")


class MetricsSink(Protocol):
    """Receives each step's metrics once the step is complete."""

    def log(self, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """Appends one JSON object per line, each written whole or not at all, so a killed run keeps every
    finished line and a full disk leaves no torn one."""

    def __init__(self, path: Path):
        """Raises:
        StorageError: the file cannot be created or opened (permissions); the message names it."""
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise StorageError(describe_os_error(error, path)) from None

    def log(self, record: dict[str, Any]) -> None:
        """Raises:
        StorageError: the line could not be written (disk full, permissions); the message names the file,
            which is left as it was before the line."""
        if self._fd is None:
            raise ValueError(f"{self.path}: log() after close()")
        line = memoryview((json.dumps(record, allow_nan=True) + "\n").encode())
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while line:
                line = line[os.write(self._fd, line) :]
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # drop the part that was written
            raise StorageError(describe_os_error(error, self.path)) from None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def truncate_jsonl_after_step(path: Path, step: int) -> int:
    """Drop records with ``"step" > step`` (work redone after a resume); returns how many were dropped.

    A torn last line (the process died mid-write) is dropped as well.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if record.get("step", 0) > step:
            dropped += 1
        else:
            kept.append(line)
    # A temporary file renamed into place: a full disk must not cost the records kept.
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        partial.replace(path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise StorageError(describe_os_error(error, path)) from None
    return dropped


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _in_notebook() -> bool:
    # An IPython kernel (Jupyter, VS Code, Colab) has imported ipykernel; a plain terminal or pipe has not.
    return "ipykernel" in sys.modules


class ProgressDisplay:
    """Step, reward, tokens/s, loss and ETA: a tqdm bar on a terminal (resized with it) or in a notebook (a
    widget where ipywidgets is installed), one plain line per step otherwise (logs, CI)."""

    def __init__(self, total_steps: int, *, stream: TextIO | None = None, interactive: bool | None = None):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        if interactive is None:
            interactive = self.stream.isatty() or _in_notebook()
        self.interactive = interactive
        self._started = time.monotonic()
        self._first_step: int | None = None
        self._bar: Any = None

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        if self._first_step is None:
            # Resumed runs start mid-way: the ETA uses only the steps timed in this process.
            self._first_step = step - 1
            self._started = time.monotonic() - float(metrics.get("step_time_s", 0.0))
        reward = metrics.get("reward_mean", float("nan"))
        tokens_per_s = metrics.get("tokens_per_s", 0.0)
        stats = (
            f"reward {reward:.3f}  {tokens_per_s:,.0f} tok/s  loss {metrics.get('loss', float('nan')):.4f}"
        )
        if self.interactive:
            self._draw(step, stats)
            return
        done = step - self._first_step
        elapsed = time.monotonic() - self._started
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        self.stream.write(f"step {step}/{self.total_steps}  {stats}  ETA {_duration(eta)}\n")
        self.stream.flush()

    def _draw(self, step: int, stats: str) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            assert self._first_step is not None
            self._bar = tqdm(
                total=self.total_steps,
                initial=self._first_step,
                file=self.stream,
                dynamic_ncols=True,  # follows the terminal's width as it is resized
                unit="step",
                desc="step",
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {postfix} [{elapsed}<{remaining}]",
            )
        self._bar.set_postfix_str(stats, refresh=False)
        self._bar.n = step
        self._bar.refresh()  # every step (steps are seconds apart; tqdm's own redraws are rate-limited)
        if step >= self.total_steps:
            self.close()

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
