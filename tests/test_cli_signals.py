"""The real CLI in subprocesses, signalled inside a chosen phase (``tests/helpers/paused_run.py`` holds it):
one live run per run directory, SIGTERM at setup, mid-step and mid-checkpoint (exit 143, no process left
behind, and the resumed run trains every prompt exactly once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers.held_runs import PROMPTS_PER_STEP, QUICKSTART, SMALL_RUN, STEPS, start_paused, wait_for
from .helpers.processes import descendants, still_running
from .helpers.waits import wait_until_sync


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_exactly_once(run_dir: Path) -> None:
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    prompts = [r["prompt_index"] for r in read_jsonl(run_dir / "rollouts.jsonl")]
    assert sorted(prompts) == list(range(STEPS * PROMPTS_PER_STEP)), "each prompt trained exactly once"
    state = json.loads((run_dir / "checkpoints" / f"step_{STEPS:06d}" / "state.json").read_text())
    assert state["data_position"] == STEPS * PROMPTS_PER_STEP
    assert state["trained_ahead"] == []


def resume(tmp_path: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None):
    """``rollflow run --resume RUN_DIR`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "rollflow", "run", "--resume", str(run_dir), "--no-progress", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_a_second_run_or_a_resume_of_a_live_run_is_refused_naming_the_lock(tmp_path):
    run_dir = tmp_path / "runs" / "quickstart"
    first, marker = start_paused(tmp_path, "step:2", hold_s=120)
    try:
        wait_for(marker, first)
        second = subprocess.run(
            [sys.executable, "-m", "rollflow", "run", str(QUICKSTART), *SMALL_RUN],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        concurrent_resume = resume(tmp_path, run_dir)
        marker.with_name(marker.name + ".release").touch()  # the first run goes on
        _, stderr = first.communicate(timeout=240)
    finally:
        first.kill()
    lock = str(Path("runs") / "quickstart" / "run.lock")  # as the config names it, relative to the cwd
    for refused in (second, concurrent_resume):
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert lock in refused.stderr
        assert f"pid {first.pid}" in refused.stderr
        assert "Traceback" not in refused.stderr
    # The refused runs touched nothing: the first one ran alone, once.
    assert first.returncode == 0, stderr[-3000:]
    assert_exactly_once(run_dir)
    assert not (run_dir / "config.resume-1.json").exists()
    assert not (run_dir / "run.lock").exists(), "released at exit"


@pytest.mark.slow
def test_killed_run_resumes_without_repeating_or_skipping_prompts(tmp_path):
    """SIGKILL (the OOM killer, a lost node) inside step 6, after the checkpoint of step 4: nothing runs at
    exit, so step 5's metrics and rollouts are on disk past the checkpoint; the resume trains from step 5
    again and keeps each step and each prompt once."""
    run_dir = tmp_path / "runs" / "quickstart"
    process, marker = start_paused(tmp_path, "step:6", hold_s=120)
    try:
        wait_for(marker, process)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000002", "step_000004"]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    resumed = resume(tmp_path, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_exactly_once(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "placement", "inference_mode", "target"),
    [
        # Everything up (2 engine servers, the router, the trainer process); SIGTERM to the run alone, as
        # `timeout` or `kill` send it.
        pytest.param(
            "setup",
            "process",
            "http",
            "process",
            marks=pytest.mark.http_only(reason="signals reach servers and the router"),
        ),
        # SIGTERM to the whole process group (systemd, Slurm), the trainer process included, mid-step.
        pytest.param(
            "step:3",
            "process",
            "local",
            "group",
            marks=pytest.mark.local_only(reason="signals reach in-process engines"),
        ),
        pytest.param(
            "step:3",
            "thread",
            "local",
            "process",
            marks=pytest.mark.local_only(reason="signals reach in-process engines"),
        ),
        # Mid-checkpoint: the trainer's files written, state.json not yet.
        pytest.param(
            "checkpoint:4",
            "thread",
            "local",
            "group",
            marks=pytest.mark.local_only(reason="signals reach in-process engines"),
        ),
        # Two data-parallel trainer workers (trainer.num_workers = 2) get the group's SIGTERM mid-step too.
        pytest.param(
            "step:3",
            "workers",
            "local",
            "group",
            marks=pytest.mark.local_only(reason="signals reach in-process engines"),
        ),
    ],
)
def test_sigterm_stops_cleanly_leaves_no_process_and_resumes_exactly_once(
    tmp_path, phase, placement, inference_mode, target
):
    run_dir = tmp_path / "runs" / "quickstart"
    env = {"ROLLFLOW_INFERENCE_MODE": inference_mode}
    trainer = "trainer.num_workers=2" if placement == "workers" else f"trainer.placement='{placement}'"
    process, marker = start_paused(
        tmp_path, phase, "--set", trainer, "--set", "inference.router_port=0", env=env
    )
    try:
        wait_for(marker, process)
        children = descendants(process.pid)
        if placement in ("process", "workers"):
            assert any("multiprocessing" in cmd for cmd in still_running(children).values())
        if inference_mode == "http":
            assert sum("rollflow serve" in cmd for cmd in still_running(children).values()) == 2
        signalled = time.monotonic()
        if target == "group":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        stop_s = time.monotonic() - signalled
    finally:
        process.kill()
    assert process.returncode == 143, stderr[-3000:]
    assert f"continue with `rollflow run --resume {Path('runs') / 'quickstart'}`" in stderr
    assert "Traceback" not in stderr
    # Servers, router and trainer process are stopped before the run exits; multiprocessing's resource
    # tracker leaves when its pipe from the run closes, a moment later.
    left = still_running(children)
    print(
        json.dumps(
            {
                "phase": phase,
                "placement": placement,
                "inference_mode": inference_mode,
                "sigterm_to": target,
                "exit_status": process.returncode,
                "stop_s": round(stop_s, 2),
                "children_at_sigterm": len(children),
                "children_left_at_exit": len(left),
                "children_left_at_exit_besides_resource_tracker": sum(
                    "resource_tracker" not in cmd for cmd in left.values()
                ),
            }
        )
    )
    assert not {pid: cmd for pid, cmd in left.items() if "resource_tracker" not in cmd}, left
    wait_until_sync(
        lambda: not still_running(children),
        lambda: f"the run's children end; left: {still_running(children)}",
    )
    assert not (run_dir / "run.lock").exists()

    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").glob("step_*"))
    if phase == "setup":
        assert checkpoints == [] and read_jsonl(run_dir / "metrics.jsonl") == []
    elif phase == "step:3":
        assert checkpoints == ["step_000002"]
    else:  # the checkpoint in progress was finished before the run stopped
        assert checkpoints == ["step_000002", "step_000004"]

    resumed = resume(tmp_path, run_dir, env={"ROLLFLOW_INFERENCE_MODE": "local"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_exactly_once(run_dir)
    assert json.loads((run_dir / "config.json").read_text())["orchestrator"]["steps"] == STEPS
    assert (run_dir / "config.resume-1.json").exists()
