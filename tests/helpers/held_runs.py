"""Small ``rollflow run``s of the quickstart held in a phase by ``paused_run.py`` (the child script), for tests
that signal or kill a run at a known point instead of at a polled time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import REPO_ROOT

QUICKSTART = REPO_ROOT / "examples" / "quickstart.toml"
PAUSED_RUN = Path(__file__).parent / "paused_run.py"
STEPS, PROMPTS_PER_STEP = 6, 4
SMALL_RUN = [
    "--no-progress",
    "--set",
    f"orchestrator.steps={STEPS}",
    "--set",
    "checkpoint.every=2",
    "--set",
    f"orchestrator.prompts_per_step={PROMPTS_PER_STEP}",
]


def start_paused(
    tmp_path: Path, phase: str, *args: str, env: dict[str, str] | None = None, hold_s: float = 4
):
    """``rollflow run QUICKSTART ARGS`` in a session of its own, held in ``phase`` for ``hold_s`` or until
    ``{marker}.release`` appears; returns the process and the marker file that appears when the phase
    begins."""
    marker = tmp_path / f"paused-{phase.replace(':', '-')}"
    process = subprocess.Popen(
        [sys.executable, str(PAUSED_RUN), "run", str(QUICKSTART), *SMALL_RUN, *args],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            **(env or {}),
            "PYTHONUNBUFFERED": "1",
            "ROLLFLOW_TEST_PAUSE": phase,
            "ROLLFLOW_TEST_PAUSE_MARKER": str(marker),
            "ROLLFLOW_TEST_PAUSE_S": str(hold_s),
        },
        start_new_session=True,
    )
    return process, marker


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return
        if process.poll() is not None:
            raise AssertionError(
                f"run exited early with {process.returncode}: {process.stderr.read()[-3000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"{path.name} did not appear in {timeout_s} s")
