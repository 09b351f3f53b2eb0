"""The process layer (``rollflow.processes``): functions are spawned (not forked) and run in the parent's
environment as it is when they start; every child dies with its parent, writes its output where it is told,
and is reaped at teardown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import textwrap

from rollflow.processes import PARENT_WATCH_THREAD, start_command, start_function, stop_functions

from .helpers.processes import process_alive, wait_dead
from .helpers.waits import wait_until_sync


def _report(conn, name: str) -> None:
    import threading

    conn.send((os.environ.get(name), sorted(thread.name for thread in threading.enumerate())))
    conn.close()


def _child_view(name: str) -> tuple[str | None, list[str]]:
    receiving, sending = multiprocessing.Pipe(duplex=False)
    process = start_function(_report, (sending, name), name="rollflow-test-child")
    sending.close()
    try:
        assert receiving.poll(120), "the child did not report within 120 s"
        return receiving.recv()
    finally:
        stop_functions([process], 30)


def test_a_child_sees_the_environment_as_it_is_when_it_starts(monkeypatch):
    name = "ROLLFLOW_TEST_CHILD_VALUE"
    monkeypatch.setenv(name, "first")
    assert _child_view(name)[0] == "first"
    monkeypatch.setenv(name, "second")
    value, threads = _child_view(name)
    assert value == "second"
    assert threads == [
        "MainThread",
        PARENT_WATCH_THREAD,
    ]  # a fresh interpreter: none of this process's threads
    monkeypatch.delenv(name)
    assert _child_view(name)[0] is None


def _print_and_wait(text: str) -> None:
    import time

    print(text, flush=True)
    time.sleep(600)


def test_a_function_writes_to_its_log_and_is_killed_and_reaped(tmp_path):
    log_path = tmp_path / "child.log"
    process = start_function(
        _print_and_wait, ("hello from the child",), name="rollflow-test-child", log_path=log_path
    )
    wait_until_sync(
        lambda: log_path.exists() and "hello from the child" in log_path.read_text(), "the child's line", 120
    )
    stop_functions([process], 0.5)
    assert process.exitcode is not None and not process_alive(process.pid)


# A parent that starts one child of each kind, prints their pids, then waits to be killed with SIGKILL.
_PARENT = textwrap.dedent(
    """
    import asyncio, sys, time
    from rollflow.processes import start_command, start_function

    def sleep_forever():
        time.sleep(600)

    async def main():
        command = await start_command([sys.executable, "-c", "import time; time.sleep(600)"], name="orphan")
        function = start_function(sleep_forever, (), name="rollflow-test-orphan")
        print(command.pid, function.pid, flush=True)
        await asyncio.sleep(600)

    if __name__ == "__main__":
        asyncio.run(main())
    """
)


def test_children_of_both_kinds_die_with_their_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(process_alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    assert wait_dead(pids, timeout_s=30) == []


async def test_a_command_that_ignores_sigterm_is_killed_with_what_it_started(tmp_path):
    # The command ignores SIGTERM and starts a grandchild in its process group that ignores it too.
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        "print(child.pid, flush=True); time.sleep(600)"
    )
    log_path = tmp_path / "command.log"
    child = await start_command(
        [sys.executable, "-c", code], name="stubborn", log_path=log_path, stdout=asyncio.subprocess.PIPE
    )
    grandchild = int(await asyncio.wait_for(child.process.stdout.readline(), 60))
    await child.stop(0.5)
    assert child.returncode is not None and not process_alive(child.pid)  # reaped: no zombie
    assert wait_dead([grandchild], timeout_s=10) == []
    assert log_path.read_text().startswith(f"$ {sys.executable} -c ")
    assert child.log_file is not None and child.log_file.closed
    await child.stop(0.5)  # idempotent
