"""Child processes are spawned (not forked) and run in the parent's environment as it is when they start."""

from __future__ import annotations

import multiprocessing
import os

from rollflow.children import start_child


def _report(conn, name: str) -> None:
    import threading

    conn.send((os.environ.get(name), threading.active_count()))
    conn.close()


def _child_view(name: str) -> tuple[str | None, int]:
    receiving, sending = multiprocessing.Pipe(duplex=False)
    process = start_child(_report, (sending, name), name="rollflow-test-child")
    sending.close()
    try:
        assert receiving.poll(120), "the child did not report within 120 s"
        return receiving.recv()
    finally:
        process.join(30)


def test_a_child_sees_the_environment_as_it_is_when_it_starts(monkeypatch):
    name = "ROLLFLOW_TEST_CHILD_VALUE"
    monkeypatch.setenv(name, "first")
    assert _child_view(name)[0] == "first"
    monkeypatch.setenv(name, "second")
    value, threads = _child_view(name)
    assert value == "second"
    assert threads == 1  # a fresh interpreter: none of this process's threads
    monkeypatch.delenv(name)
    assert _child_view(name)[0] is None
