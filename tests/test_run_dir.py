"""Run-directory rules: the lock (exclusion, release, a crashed holder), resume rules (from step 0 without a
checkpoint, meaning changes refused unless forced, every config kept) and write failures on a real full or
read-only file system, and a directory without write permission."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import CheckpointError, ConfigError, RunDirectoryInUseError, StorageError
from rollflow.metrics import JsonlWriter, truncate_jsonl_after_step
from rollflow.orchestrator.checkpoint import latest_checkpoint, list_checkpoints, load_state
from rollflow.orchestrator.run_dir import (
    RunLock,
    config_history,
    latest_config,
    meaning_changes,
    write_resume_config,
)

from .conftest import REPO_ROOT
from .helpers.waits import wait_until_sync

SMALL = [
    "orchestrator.prompts_per_step=4",
    "sampling.samples_per_prompt=4",
    "sampling.max_tokens=4",
    "data.task='digit'",
    "inference.router_port=0",  # runs in http mode start a router; tests run side by side
]


def small_config(output_dir: Path, *overrides: str):
    return load_config([], [f"output_dir='{output_dir}'", "name=t", *SMALL, *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ the lock


def test_lock_excludes_a_second_holder_and_is_released(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    first = RunLock(run_dir)
    first.acquire()
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirectoryInUseError) as info:
        RunLock(run_dir).acquire()
    assert str(run_dir / "run.lock") in str(info.value)
    assert f"pid {os.getpid()}" in str(info.value)
    first.release()
    first.release()  # idempotent
    assert not (run_dir / "run.lock").exists()
    with RunLock(run_dir):
        pass


HOLD_LOCK = """
import sys, time
from rollflow.orchestrator.run_dir import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    run_dir = tmp_path / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUseError, match=f"pid {holder.pid}"):
            RunLock(run_dir).acquire()
        holder.send_signal(signal.SIGKILL)  # no cleanup: the lock file stays, with the dead pid in it
        holder.wait()
    finally:
        holder.kill()
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid
    with RunLock(run_dir):
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()


FORK_AND_EXIT = """
import os, sys, time
from rollflow.orchestrator.run_dir import RunLock
RunLock(sys.argv[1]).acquire()
fork = os.fork()
if fork == 0:
    for stream in (1, 2):  # let the parent's output end
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream)
    time.sleep(60)  # the fork shares the lock
    os._exit(0)
print(fork, flush=True)
os._exit(0)
"""


def test_a_lock_kept_by_a_fork_of_a_dead_holder_says_so(tmp_path):
    run_dir = tmp_path / "r"
    result = subprocess.run(
        [sys.executable, "-c", FORK_AND_EXIT, str(run_dir)],
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    fork = int(result.stdout)
    holder = json.loads((run_dir / "run.lock").read_text())["pid"]
    with pytest.raises(RunDirectoryInUseError) as info:
        RunLock(run_dir).acquire()
    assert f"pid {holder}" in str(info.value) and "not running any more" in str(info.value)
    os.kill(fork, signal.SIGKILL)

    def acquired() -> bool:
        try:
            with RunLock(run_dir):
                return True
        except RunDirectoryInUseError:
            return False

    wait_until_sync(acquired, "the lock is free once the fork is killed")


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_an_orchestrator_holds_the_lock_from_setup_to_stop(tmp_path):
    config = small_config(tmp_path / "runs", "orchestrator.steps=1")
    orchestrator = await Orchestrator.start(config)
    try:
        with pytest.raises(RunDirectoryInUseError, match="run.lock"):
            await Orchestrator.start(config, resume=True)
        await orchestrator.run()
    finally:
        await orchestrator.stop()
    assert not (config.run_dir / "run.lock").exists()
    assert json.loads((config.run_dir / "config.json").read_text())["orchestrator"]["steps"] == 1


# ------------------------------------------------------------------------------------------ resume rules


def test_config_history_never_overwrites(tmp_path):
    assert latest_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{}")
    assert write_resume_config(tmp_path, b"1").name == "config.resume-1.json"
    (tmp_path / "config.resume-3.json").write_text("3")
    assert write_resume_config(tmp_path, b"4").name == "config.resume-4.json"
    assert [p.name for p in config_history(tmp_path)] == [
        "config.json",
        "config.resume-1.json",
        "config.resume-3.json",
        "config.resume-4.json",
    ]
    assert latest_config(tmp_path).read_text() == "4"


def test_meaning_changes_name_each_key():
    saved = {"seed": 0, "model": {"path": "a"}, "sampling": {"samples_per_prompt": 8, "max_tokens": 8}}
    new = {"seed": 1, "model": {"path": "a"}, "sampling": {"samples_per_prompt": 4, "max_tokens": 99}}
    assert meaning_changes(saved, new) == ["sampling.samples_per_prompt: 8 -> 4", "seed: 0 -> 1"]


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_zero(tmp_path):
    config = small_config(tmp_path / "runs", "orchestrator.steps=3", "checkpoint.every=2")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=1)  # stopped after step 1: metrics, no checkpoint
    run_dir = config.run_dir
    assert latest_checkpoint(run_dir) is None and len(read_jsonl(run_dir / "metrics.jsonl")) == 1
    # A fresh run with the same name says what to do...
    with pytest.raises(
        ConfigError, match=r"no checkpoint yet: restart it from step 0 with `rollflow run --resume"
    ):
        await Orchestrator.start(config)
    # ...and the resume starts over, recording step 1 once.
    async with Orchestrator(config, resume=True) as orchestrator:
        assert orchestrator.state.step == 0
        await orchestrator.run()
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(r["prompt_index"] for r in read_jsonl(run_dir / "rollouts.jsonl")) == list(range(12))
    assert [p.name for p in config_history(run_dir)] == ["config.json", "config.resume-1.json"]


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_resume_refuses_a_change_of_meaning_unless_forced_and_keeps_every_config(tmp_path):
    config = small_config(tmp_path / "runs", "orchestrator.steps=2", "checkpoint.every=1")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=1)
    original = (config.run_dir / "config.json").read_bytes()
    changed = small_config(tmp_path / "runs", "orchestrator.steps=2", "sampling.samples_per_prompt=2")
    with pytest.raises(ConfigError) as info:
        await Orchestrator.start(changed, resume=True)
    message = str(info.value)
    assert "sampling.samples_per_prompt: 4 -> 2" in message and "--force" in message
    assert config_history(config.run_dir) == [config.run_dir / "config.json"], (
        "a refused resume records nothing"
    )
    # A change that keeps the meaning (more steps) needs no force; each resume's config is recorded.
    longer = small_config(tmp_path / "runs", "orchestrator.steps=3", "checkpoint.every=1")
    async with Orchestrator(longer, resume=True) as orchestrator:
        await orchestrator.run(steps=1)
    async with Orchestrator(changed, resume=True, force=True) as orchestrator:
        assert orchestrator.state.step == 2
    assert (config.run_dir / "config.json").read_bytes() == original
    saved = [json.loads(p.read_text()) for p in config_history(config.run_dir)]
    assert [c["orchestrator"]["steps"] for c in saved] == [2, 3, 2]
    assert [c["sampling"]["samples_per_prompt"] for c in saved] == [4, 4, 2]


async def test_resume_of_a_directory_without_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no run was started there"):
        await Orchestrator.start(small_config(tmp_path / "runs"), resume=True)


async def test_a_notebook_cell_run_again_says_how_in_python_and_overwrite_starts_afresh(tmp_path):
    config = small_config(tmp_path / "runs", "orchestrator.steps=2", "checkpoint.every=1")
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=1)
    run_dir = config.run_dir
    # The same cell again: refused, in the embedded API's own terms too.
    with pytest.raises(ConfigError) as info:
        await Orchestrator.start(config)
    assert "Orchestrator(config, resume=True)" in str(info.value)
    assert "Orchestrator(config, overwrite=True)" in str(info.value)
    with pytest.raises(ValueError, match="pass one"):
        Orchestrator(config, resume=True, overwrite=True)
    # overwrite=True: a fresh run from step 0; the old checkpoints, metrics and configs are gone.
    (run_dir / "notes.txt").write_text("left by the user in the run directory")
    async with Orchestrator(config, overwrite=True) as orchestrator:
        assert orchestrator.state.step == 0
        await orchestrator.run()
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in config_history(run_dir)] == ["config.json"]
    assert load_state(list_checkpoints(run_dir)[-1]).step == 2
    assert not (run_dir / "notes.txt").exists()
    # overwrite of a directory with nothing in it is a plain fresh run.
    fresh = small_config(tmp_path / "other", "orchestrator.steps=1")
    async with Orchestrator(fresh, overwrite=True) as orchestrator:
        await orchestrator.run()
    assert [m["step"] for m in read_jsonl(fresh.run_dir / "metrics.jsonl")] == [1]


def rollflow_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow", "run", "--no-progress", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_cli_resume_says_when_nothing_is_left_and_keeps_every_config(tmp_path):
    quickstart = str(REPO_ROOT / "examples" / "quickstart.toml")
    small = [arg for override in SMALL for arg in ("--set", override)]
    run_dir = Path("runs") / "quickstart"
    assert rollflow_run(tmp_path, quickstart, *small, "--set", "orchestrator.steps=2").returncode == 0
    original = (tmp_path / run_dir / "config.json").read_text()

    done = rollflow_run(tmp_path, "--resume", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nothing to do" in done.stderr and "orchestrator.steps = 2" in done.stderr

    fewer = rollflow_run(tmp_path, "--resume", str(run_dir), "--set", "orchestrator.steps=1")
    assert fewer.returncode == 2, fewer.stderr[-3000:]
    assert "orchestrator.steps = 1 is below the 2 steps the run has done" in fewer.stderr

    again = rollflow_run(tmp_path, quickstart, *small, "--set", "orchestrator.steps=2")
    assert again.returncode == 2 and f"rollflow run --resume {run_dir}" in again.stderr

    more = ["--set", "orchestrator.steps=3", "--set", "seed=3"]
    changed = rollflow_run(tmp_path, "--resume", str(run_dir), *more)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "seed: 0 -> 3" in changed.stderr and "--force" in changed.stderr
    forced = rollflow_run(tmp_path, "--resume", str(run_dir), *more, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert (tmp_path / run_dir / "config.json").read_text() == original
    resumed = json.loads((tmp_path / run_dir / "config.resume-1.json").read_text())
    assert (resumed["seed"], resumed["orchestrator"]["steps"]) == (3, 3)
    assert [m["step"] for m in read_jsonl(tmp_path / run_dir / "metrics.jsonl")] == [1, 2, 3]

    misuse = rollflow_run(tmp_path, quickstart, "--force")
    assert misuse.returncode == 2 and "--force only applies with --resume" in misuse.stderr
    escape = rollflow_run(tmp_path, quickstart, "--set", "name='..'")
    assert escape.returncode == 2 and "name = '..' must be a plain directory name" in escape.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# -------------------------------------------------------------------- a real full or read-only disk


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs of a given size (root only; skipped where mounting is not allowed)."""
    mounts = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounts)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _fill(directory: Path) -> None:
    with contextlib.suppress(OSError), (directory / "filler").open("wb") as file:
        while True:
            file.write(b"\0" * 65536)
            file.flush()


def test_a_full_disk_fails_a_metrics_line_naming_the_file(small_disk):
    disk = small_disk("256k")
    writer = JsonlWriter(disk / "run" / "metrics.jsonl")
    writer.log({"step": 1})
    _fill(disk)
    with pytest.raises(StorageError) as info:
        writer.log({"step": 2, "pad": "x" * 10000})
    assert str(disk / "run" / "metrics.jsonl") in str(info.value)
    assert "No space left on device" in str(info.value) and "MiB free" in str(info.value)
    writer.close()
    assert read_jsonl(disk / "run" / "metrics.jsonl") == [{"step": 1}], "no torn line"
    # A resume's truncation rewrites under another name: a full disk keeps the lines it had.
    with pytest.raises(StorageError):
        truncate_jsonl_after_step(disk / "run" / "metrics.jsonl", 1)
    assert read_jsonl(disk / "run" / "metrics.jsonl")[0] == {"step": 1}


def test_a_read_only_file_system_is_named(small_disk):
    disk = small_disk("1m")
    (disk / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(StorageError) as info:
        JsonlWriter(disk / "run" / "metrics.jsonl")
    assert str(disk / "run" / "metrics.jsonl") in str(info.value)
    assert "Read-only file system" in str(info.value) and "output_dir" in str(info.value)


def test_a_run_on_a_read_only_file_system_names_the_path(tmp_path, small_disk):
    disk = small_disk("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "rollflow", "run", str(REPO_ROOT / "examples" / "quickstart.toml")),
            *("--no-progress", "--set", f"output_dir='{disk}'"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"error: cannot write {disk / 'quickstart'}: Read-only file system" in result.stderr
    assert "set output_dir to a writable directory" in result.stderr
    assert "Traceback" not in result.stderr


AS_NOBODY = """
import os, sys
from pathlib import Path
from rollflow.errors import StorageError
from rollflow.metrics import JsonlWriter
from rollflow.orchestrator.run_dir import RunLock
os.setgid(65534)
os.setuid(65534)  # from here on, the root-owned directory is not writable
for attempt in (lambda: JsonlWriter(Path(sys.argv[1]) / "metrics.jsonl"), lambda: RunLock(sys.argv[1]).acquire()):
    try:
        attempt()
    except StorageError as error:
        print(error)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root privileges to meet a real permission error")
def test_a_directory_without_write_permission_is_named():
    # Not under tmp_path: pytest's base directory is closed to other users.
    run_dir = Path(tempfile.mkdtemp(prefix="rollflow-perm-"))
    try:
        run_dir.chmod(0o755)
        result = subprocess.run(
            [sys.executable, "-c", AS_NOBODY, str(run_dir)], capture_output=True, text=True, timeout=60
        )
    finally:
        shutil.rmtree(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"cannot write {run_dir / 'metrics.jsonl'}: Permission denied; make it writable or set output_dir "
        "to a writable directory",
        f"cannot write {run_dir / 'run.lock'}: Permission denied; make it writable or set output_dir to a "
        "writable directory",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["thread", "process"])
def test_a_full_disk_during_a_checkpoint_names_it_and_keeps_the_last_one(tmp_path, small_disk, placement):
    """The real CLI with output_dir on a disk that holds one checkpoint of the tiny model but not two."""
    disk = small_disk("3200k")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow",
            "run",
            str(REPO_ROOT / "examples" / "quickstart.toml"),
            "--no-progress",
            "--set",
            f"output_dir='{disk}'",
            "--set",
            "name=full",
            *[arg for override in SMALL for arg in ("--set", override)],
            "--set",
            "orchestrator.steps=4",
            "--set",
            "checkpoint.every=2",
            "--set",
            f"trainer.placement='{placement}'",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run_dir = disk / "full"
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    print(f"full disk, trainer.placement = {placement}: {error}")
    assert error.startswith("error: cannot write "), error
    assert str(run_dir / "checkpoints" / "step_000004.tmp") in error
    assert "disk is full" in error or "No space left on device" in error, error
    assert f"the last complete checkpoint, {run_dir / 'checkpoints' / 'step_000002'}, is intact" in error
    assert "Traceback" not in result.stderr
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002"]
    assert not (run_dir / "checkpoints" / "step_000004.tmp").exists(), "the partial checkpoint is removed"
    assert load_state(run_dir / "checkpoints" / "step_000002").step == 2
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").stat().st_size > 0
