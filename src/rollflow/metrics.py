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


class ProgressDisplay:
    """Step, reward, tokens/s and ETA: a redrawn bar on a terminal, one plain line per step otherwise."""

    def __init__(self, total_steps: int, *, stream: TextIO | None = None, interactive: bool | None = None):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self._started = time.monotonic()
        self._first_step: int | None = None

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        if self._first_step is None:
            # Resumed runs start mid-way: the ETA uses only the steps timed in this process.
            self._first_step = step - 1
            self._started = time.monotonic() - float(metrics.get("step_time_s", 0.0))
        done = step - self._first_step
        elapsed = time.monotonic() - self._started
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        reward = metrics.get("reward_mean", float("nan"))
        tokens_per_s = metrics.get("tokens_per_s", 0.0)
        text = (
            f"step {step}/{self.total_steps}  reward {reward:.3f}  "
            f"{tokens_per_s:,.0f} tok/s  loss {metrics.get('loss', float('nan')):.4f}  "
            f"ETA {_duration(eta)}"
        )
        if self.interactive:
            width = 24
            filled = round(width * step / max(self.total_steps, 1))
            bar = "█" * filled + "·" * (width - filled)
            self.stream.write(f"\r\x1b[2K[{bar}] {text}")
            if step >= self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
