"""How rollflow starts child processes, and makes sure none outlives it.

Two kinds of child, one set of guarantees:

- ``start_function``: a Python function in a freshly spawned interpreter (the trainer process, trainer
  ranks). Spawned, never forked, since the parent may hold threads (the event loop's executor, torch's pools)
  that a fork would copy mid-operation; the child runs with the parent's environment as it is when it starts.
- ``start_command``: a command line (``python -m rollflow serve|router``, ``vllm serve``, a proxy worker,
  a user's agent program), as an asyncio subprocess.

Each child dies with its parent: a command gets SIGTERM from the kernel when the parent dies
(``PR_SET_PDEATHSIG``, Linux); a function's interpreter watches the parent's pid (a pidfd where the OS has
them, which a reused pid cannot fool) and exits within a second of it. A spawned child is not watched by
``PR_SET_PDEATHSIG``, which fires when the parent *thread* that started it ends, and functions are often
started from worker threads. Output goes where the parent's goes, or to a named log file. Teardown
(``CommandChild.stop``, ``stop_functions``) asks, waits until a deadline, kills, and reaps, so no zombie or
orphan is left.

This module sits beside ``channels`` and ``messages`` rather than in ``rollflow.launch``: the components
that start children (``train``, ``tito``, ``rollout``) sit below ``launch``, which imports ``train``.

A fork server that imports torch once would start functions in milliseconds instead of seconds; it was tried
and set aside: late in a long test session, children forked from it exited during weight pushes without a
traceback reaching the parent (their output goes to the server's streams, not the parent's).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio
import structlog

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
PARENT_WATCH_THREAD = "rollflow-parent-watch"
"""Name of the thread with which a spawned function's interpreter watches its parent."""

# ------------------------------------------------------------------------------ functions (spawned)


def start_function(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    name: str,
    log_path: str | os.PathLike[str] | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start ``target(*args)`` in a spawned daemon interpreter that exits when this process does.

    ``target`` and ``args`` must pickle (a module-level function). Its output goes to this process's
    standard streams, or appended to ``log_path``. Stop it with ``stop_functions``.
    """
    path = None if log_path is None else str(log_path)
    process = multiprocessing.get_context("spawn").Process(
        target=_run_function, args=(target, args, os.getpid(), path), name=name, daemon=True
    )
    process.start()
    return process


def _run_function(
    target: Callable[..., Any], args: tuple[Any, ...], parent: int, log_path: str | None
) -> None:
    if log_path is not None:
        _write_output_to(log_path)
    watch_parent(parent)
    target(*args)


def _write_output_to(log_path: str) -> None:
    """Point this process's stdout and stderr (the descriptors, so C libraries' output too) at ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def watch_parent(parent: int) -> None:
    """End this process (exit code 1) within a second of process ``parent`` exiting, from a daemon thread:
    a child stuck in a collective or a long call never reads the pipe whose closing would tell it."""
    threading.Thread(target=_exit_with_parent, args=(parent,), name=PARENT_WATCH_THREAD, daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    try:
        handle = os.pidfd_open(parent)
    except (AttributeError, OSError):
        handle = None
    if handle is not None:
        select.select([handle], [], [])  # readable once the process has exited
    else:
        while _alive(parent):
            time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_functions(processes: Sequence[multiprocessing.process.BaseProcess], grace_s: float) -> None:
    """Wait until ``grace_s`` from now for each process to exit (ask it first, e.g. over its pipe), then kill
    those left and reap them all; ``grace_s = 0`` kills at once (and quietly: the caller knows why).
    Idempotent; blocks (call it from a worker thread in async code)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        if process.pid is not None:
            process.join(max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            if grace_s > 0:
                log.warning("child process did not exit; killing it", name=process.name, pid=process.pid)
            process.kill()
    for process in processes:
        if process.pid is not None:
            process.join()


# ------------------------------------------------------------------------------ commands (asyncio)


def _prepare_command(parent: int, niceness: int) -> None:
    """Runs in the child between fork and exec: lower its priority by ``niceness`` (every thread it starts
    inherits it), and ask the kernel for SIGTERM when the parent dies."""
    if niceness:
        os.nice(niceness)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


class CommandChild:
    """A command started by ``start_command``: its ``asyncio.subprocess.Process`` (``process``, for its pipes),
    the log file its output goes to (``log_file``, when it has one), and ``stop``."""

    def __init__(
        self, process: asyncio.subprocess.Process, log_file: IO[bytes] | None, own_group: bool, name: str
    ):
        self.name = name
        self.process = process
        self.log_file = log_file
        self.own_group = own_group

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def wait(self) -> int:
        """Wait for the command to exit; its exit code."""
        return await self.process.wait()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                os.killpg(self.process.pid, sig)
            elif self.process.returncode is None:
                self.process.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM to the command (its whole process group when it has its own)."""
        self._signal(signal.SIGTERM)

    async def stop(self, grace_s: float, *, terminate: bool = True) -> None:
        """SIGTERM it (unless ``terminate`` is false: it was already asked some other way), wait until
        ``grace_s`` from now, SIGKILL it, reap it and close its log. In its own process group, the SIGKILL goes
        to the group even after a clean exit, so children the command left behind die with it. Idempotent;
        finishes even when the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            if terminate:
                self.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), max(grace_s, 0.01))
            except TimeoutError:
                log.warning("child process did not exit; killing it", name=self.name, pid=self.process.pid)
            self._signal(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await self.process.wait()
            if self.log_file is not None:
                self.log_file.close()


async def start_command(
    argv: Sequence[str],
    *,
    name: str,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    stdin: Any = asyncio.subprocess.DEVNULL,
    stdout: Any = None,
    stderr: Any = None,
    own_group: bool = True,
    niceness: int = 0,
    pass_fds: Sequence[int] = (),
) -> CommandChild:
    """Start ``argv`` as a child that dies with this process (SIGTERM from the kernel, on Linux).

    Args:
        argv: the command line (``["/bin/sh", "-c", text]`` for a shell command).
        name: what it is, for the log (``server-0``, ``proxy-worker-1``).
        env: its whole environment (default: this process's).
        log_path: a log file, opened for appending with the command line written first; it takes the output
            that ``stdout``/``stderr`` do not redirect. Without it the output goes where this process's goes.
        stdin, stdout, stderr: as for ``asyncio.create_subprocess_exec`` (``asyncio.subprocess.PIPE`` etc.).
        own_group: run it in its own session and process group, so that teardown signals whatever it started
            too, and a terminal's Ctrl-C reaches only this process (which then stops it).
        niceness: how much to lower its priority (0..19).
        pass_fds: descriptors it inherits.
    """
    log_file = None
    if log_path is not None:
        log_file = open(Path(log_path), "ab")  # noqa: SIM115 - closed by CommandChild.stop
        log_file.write(f"$ {' '.join(argv)}\n".encode())
        log_file.flush()
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin,
            stdout=stdout if stdout is not None else log_file,
            stderr=stderr if stderr is not None else log_file,
            env=dict(env) if env is not None else None,
            start_new_session=own_group,
            pass_fds=tuple(pass_fds),
            preexec_fn=functools.partial(_prepare_command, os.getpid(), niceness),
        )
    except BaseException:
        if log_file is not None:
            log_file.close()
        raise
    return CommandChild(process, log_file, own_group, name)
