"""Child processes start from a fork server with torch imported, in the parent's current environment."""

from __future__ import annotations

import multiprocessing
import os

from rollflow.children import start_child


def _report(conn, name: str) -> None:
    import sys

    conn.send((os.environ.get(name), os.getppid(), "torch" in sys.modules))
    conn.close()


def _child_view(name: str) -> tuple[str | None, int, bool]:
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
    assert _child_view(name)[0] == "first"  # the fork server may have started here
    monkeypatch.setenv(name, "second")  # after the fork server started
    value, parent, torch_loaded = _child_view(name)
    assert value == "second"
    monkeypatch.delenv(name)
    assert _child_view(name)[0] is None
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert parent != os.getpid()  # forked by the server, not by this process
        assert torch_loaded  # imported once by the server, before the fork
