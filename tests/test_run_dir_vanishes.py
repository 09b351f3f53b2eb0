"""A run whose directory is deleted under it stops with an error naming the directory (rc 1 from the CLI)
instead of ending well after writing into unlinked files and a recreated ``checkpoints/``."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from rollflow import Orchestrator
from rollflow.errors import RunDirectoryGoneError
from rollflow.orchestrator.run_dir import RunLock

from .conftest import REPO_ROOT
from .helpers.runs import SMALL, small_config
from .helpers.waits import wait_until_sync


def test_the_lock_notices_its_directory_deleted_or_replaced(tmp_path):
    run_dir = tmp_path / "run"
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        lock.check_held()
        shutil.rmtree(run_dir)
        with pytest.raises(RunDirectoryGoneError, match=str(run_dir)):
            lock.check_held()
        # A recreated directory with a lock file of its own (another run's) is not ours either...
        other = RunLock(run_dir)
        other.acquire()
        with pytest.raises(RunDirectoryGoneError):
            lock.check_held()
        # ...and releasing ours leaves the other's file in place.
        lock.release()
        assert other.path.exists()
        other.check_held()
        other.release()
    finally:
        lock.release()


async def test_a_run_stops_at_the_first_step_after_its_directory_is_deleted(tmp_path):
    config = small_config(tmp_path / "runs", "orchestrator.steps=3", "checkpoint.every=1")
    run_dir = config.run_dir
    steps: list[int] = []

    def delete_after_the_first_step(metrics):
        steps.append(metrics["step"])
        if metrics["step"] == 1:
            shutil.rmtree(run_dir)

    async with Orchestrator(config) as orchestrator:
        with pytest.raises(RunDirectoryGoneError, match=str(run_dir)):
            await orchestrator.run(on_step=delete_after_the_first_step)
    assert steps == [1]
    # Nothing recreated it (checkpoints/ used to come back alone).
    assert not run_dir.exists()


@pytest.mark.slow
def test_cli_run_exits_1_naming_the_deleted_directory(tmp_path):
    quickstart = str(REPO_ROOT / "examples" / "quickstart.toml")
    small = [arg for override in SMALL for arg in ("--set", override)]
    run_dir = tmp_path / "runs" / "quickstart"
    # 200 steps: without the check the run ends (rc 0) long after the delete; with it, at the next step.
    args = [quickstart, *small, "--set", "orchestrator.steps=200", "--set", "checkpoint.every=0"]
    process = subprocess.Popen(
        [sys.executable, "-m", "rollflow", "run", "--no-progress", *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until_sync(
            lambda: process.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") >= 1),
            "the run's first metrics line",
            timeout_s=240,
        )
        assert process.poll() is None, process.stderr.read()[-3000:]
        shutil.rmtree(run_dir)
        _, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, stderr[-3000:]
    assert "the run directory" in stderr and "runs/quickstart was deleted" in stderr, stderr[-3000:]
    assert not run_dir.exists()
