"""The quickstart as the benchmarks run it: ``rollflow run examples/quickstart.toml`` in a subprocess, with
``--set`` overrides, in a directory of its own; its step metrics and wall time come back. Shared by the
learning benchmarks (not a benchmark itself: it prints nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.toml"


def run_quickstart(directory: Path, overrides: list[str], label: str) -> tuple[list[dict], float]:
    """Run the quickstart in ``directory`` with ``--set`` ``overrides`` (``"key=value"``); returns the rows of
    its ``metrics.jsonl`` and the wall time in seconds. A failed run ends the benchmark naming ``label``."""
    command = [sys.executable, "-m", "rollflow", "run", str(QUICKSTART), "--no-progress"]
    for override in overrides:
        command += ["--set", override]
    started = time.monotonic()
    result = subprocess.run(command, cwd=directory, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{label} failed:\n{result.stderr[-3000:]}")
    lines = (directory / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], elapsed


def run_measured(
    command: list[str], directory: Path, label: str, env: dict[str, str] | None = None
) -> tuple[float, float, float]:
    """Run ``command`` in ``directory`` (with ``env`` added to this environment); returns its wall time (s),
    peak resident set size (MiB: the largest of the process and the descendants it waited for) and CPU time
    (user + system, s, the same processes), from ``wait4``, which reports this one child's usage alone. A failed
    run ends the benchmark naming ``label``."""
    import os

    started = time.monotonic()
    with open(directory / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            command,
            cwd=directory,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{label} failed:\n{(directory / 'stderr.txt').read_text()[-3000:]}")
    # ru_maxrss is in KiB on Linux.
    return elapsed, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def quickstart_command(overrides: list[str]) -> list[str]:
    """``rollflow run examples/quickstart.toml --no-progress`` with ``--set`` ``overrides``."""
    command = [sys.executable, "-m", "rollflow", "run", str(QUICKSTART), "--no-progress"]
    for override in overrides:
        command += ["--set", override]
    return command


def read_metrics(directory: Path, name: str = "quickstart") -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` under ``directory/runs/<name>``."""
    lines = (directory / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
