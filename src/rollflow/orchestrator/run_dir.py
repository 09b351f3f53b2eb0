"""The run directory's rules: one live run at a time, every config a run ran with kept, resumes that keep
the run's meaning.

- ``run.lock``: an exclusive ``flock`` held by the process that runs (or resumes) the run, for the run's
  life. The kernel drops it when that process exits, however it exits (``kill -9`` included), so a crashed
  run never blocks the next one; the file records the holder's pid and host for the refusal message. The run
  checks at each step's metrics and each checkpoint that the file is still the one it holds
  (``RunLock.check_held``) and stops if the directory was deleted or replaced under it.
- ``config.json``: the config the run started with, never overwritten; each resume writes
  ``config.resume-N.json`` (N = 1, 2, …), the config that resume ran with. The newest of them is the base of
  the next resume.
- A resume that changes what the run means (the model, the task or its data, the group size, the seeds)
  is refused unless forced: its checkpoints and metrics would otherwise mix two experiments.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from rollflow.errors import RunDirectoryGoneError, RunDirectoryInUseError, StorageError, describe_os_error

log = structlog.get_logger(__name__)

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"
_RESUME_CONFIG = re.compile(r"config\.resume-(\d+)\.json")

MEANING_KEYS = (
    "model.path",
    "model.renderer",
    "data.task",
    "data.path",
    "data.split",
    "data.prompt_key",
    "data.answer_key",
    "data.shuffle",
    "data.args",
    "data.reward",
    "data.rewards",
    "data.seed",
    "sampling.samples_per_prompt",
    "seed",
    "agent.callable",
    "agent.command",
    "env.kind",
    "env.id",
    "env.args",
)
"""Config keys a resume may not change without ``--force``: they define what the checkpoints and metrics
so far are of (the policy, its task and data stream, the group size its advantages assume, the seeds)."""


def _is_file_at(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd`` (same device and inode)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


class RunLock:
    """The exclusive lock of one run directory (``{run_dir}/run.lock``); see the module docstring.

    ``acquire`` and ``release``, or ``with RunLock(run_dir):``. Two ``RunLock``s of one directory exclude each
    other also within one process.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (creating the run directory), or refuse.

        Raises:
            RunDirectoryInUseError: another process (or another ``RunLock`` here) holds it; the message names
                the lock file and the holder's pid and host.
            StorageError: the run directory cannot be created or the lock file cannot be written (read-only
                file system, permissions, full disk); the message names the path.
        """
        if self._fd is not None:
            return
        try:
            self._acquire()
        except OSError as error:
            raise StorageError(describe_os_error(error, error.filename or self.path)) from None

    def _acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirectoryInUseError(self._in_use_message()) from None
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise RunDirectoryInUseError(
                        f"cannot lock {self.path}: its file system does not support file locks ({error}); "
                        "put output_dir on a local or NFS file system"
                    ) from None
                raise
            # A holder that released (and removed the file) between our open and flock leaves us holding a
            # lock on a file nobody else can see: check it is still the file at the path, else try again.
            if _is_file_at(fd, self.path):
                break
            os.close(fd)
        previous = _read_record(fd)
        if previous.get("pid") is not None:
            log.info("taking a stale run lock", path=str(self.path), previous_pid=previous.get("pid"))
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        # Only our own file: after the directory was deleted, the path may name another run's lock.
        if _is_file_at(fd, self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still locked, so no one takes a file that is about to vanish
        os.close(fd)

    def check_held(self) -> None:
        """Check the run directory is still the one this lock was taken in: its lock file is still the file
        this lock holds open (same inode; one ``fstat`` and one ``stat``). A no-op when not held.

        Raises:
            RunDirectoryGoneError: the lock file is gone or is another file (the directory was deleted, moved
                or replaced while the run held it); the message names the directory.
        """
        fd = self._fd
        if fd is None or _is_file_at(fd, self.path):
            return
        raise RunDirectoryGoneError(
            f"the run directory {self.run_dir} was deleted, moved or replaced while this run held it "
            f"({self.path} is gone or is another file): stopping rather than writing into a recreated "
            "directory (the metrics, rollouts and configs written there are lost with it). Keep the "
            "directory until the run ends; start a new run, or resume from a copy of the directory"
        )

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _in_use_message(self) -> str:
        record: dict[str, Any] = {}
        with contextlib.suppress(OSError):
            record = _parse_record(self.path.read_bytes())
        pid, host = record.get("pid"), record.get("host")
        if pid is None:
            holder = "another process (it has not written its pid yet)"
        else:
            here = host in (None, socket.gethostname())
            holder = f"pid {pid}" + ("" if here else f" on host {host}")
            if record.get("started_at"):
                holder += f", since {record['started_at']}"
            if here and not _alive(pid):
                # The lock outlives its taker only in a process that inherited it (a fork of it).
                holder += (
                    f" (not running any more: a process it forked still holds the lock; `fuser {self.path}`)"
                )
        return (
            f"run directory {self.run_dir} is in use: its lock {self.path} is held by {holder}. "
            "Wait for that run to finish or stop it (it can be resumed later), or pick another `name` "
            "(e.g. --set name=...)"
        )


def check_unlocked(run_dir: str | os.PathLike[str]) -> None:
    """Refuse early (before loading anything) when a live run holds ``run_dir``.

    Raises:
        RunDirectoryInUseError: see ``RunLock.acquire``.
    """
    if not (Path(run_dir) / LOCK_FILE).exists():
        return
    with RunLock(run_dir):
        pass


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _read_record(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        return _parse_record(os.pread(fd, 4096, 0))
    return {}


def _parse_record(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


# ---------------------------------------------------------------------------------------- config history


def config_history(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The configs the run ran with, oldest first: ``config.json``, then ``config.resume-N.json`` by N."""
    run_dir = Path(run_dir)
    resumes = [path for path in run_dir.glob("config.resume-*.json") if _RESUME_CONFIG.fullmatch(path.name)]
    resumes.sort(key=lambda path: int(_RESUME_CONFIG.fullmatch(path.name)[1]))
    first = run_dir / CONFIG_FILE
    return ([first] if first.exists() else []) + resumes


def latest_config(run_dir: str | os.PathLike[str]) -> Path | None:
    """The config the run last ran with (the base of a resume), or None for no run."""
    history = config_history(run_dir)
    return history[-1] if history else None


def write_resume_config(run_dir: str | os.PathLike[str], data: bytes) -> Path:
    """Record the config of a resume as the next ``config.resume-N.json`` (never replacing one).

    Raises:
        StorageError: it could not be written (disk full, permissions); the message names it.
    """
    run_dir = Path(run_dir)
    history = config_history(run_dir)
    number = int(_RESUME_CONFIG.fullmatch(history[-1].name)[1]) + 1 if len(history) > 1 else 1
    while True:
        path = run_dir / f"config.resume-{number}.json"
        try:
            with path.open("xb") as file:
                file.write(data)
            return path
        except FileExistsError:
            number += 1
        except OSError as error:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise StorageError(describe_os_error(error, path)) from None


def meaning_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each of ``MEANING_KEYS`` that differs between two config dicts."""
    changes = []
    for key in MEANING_KEYS:
        if key.startswith("data.") and key.split(".")[1] not in saved.get("data", {key.split(".")[1]: None}):
            continue  # a key newer than the saved config: the run used what is now its default
        old_value, new_value = _lookup(saved, key), _lookup(new, key)
        if old_value != new_value:
            changes.append(f"{key}: {old_value!r} -> {new_value!r}")
    return changes


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def clear_run_dir(run_dir: Path) -> None:
    """Delete what a run left in ``run_dir`` (checkpoints, metrics, recorded configs, logs), all but its lock
    file, which the caller holds.

    Raises:
        StorageError: an entry could not be deleted (the message names it).
    """
    for entry in Path(run_dir).iterdir():
        if entry.name == LOCK_FILE:
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as error:
            raise StorageError(describe_os_error(error, error.filename or entry)) from None
