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
