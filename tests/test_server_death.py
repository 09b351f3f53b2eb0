"""A managed server that dies while in use: the error names it, not only the call that failed.

Real ``rollflow serve`` servers started by rollflow (``inference.mode = "http"``, no external URLs), SIGKILLed
from the test while the client (or a whole ``rollflow run``) uses them. The error (``ServerDiedError``) names the
server's index and URL, its pid, the signal or exit code, and its log's path and last lines, and still says
which call failed (its cause).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rollflow.config import build_config
from rollflow.errors import RemoteInferenceError, ServerDiedError
from rollflow.inference.setup import get_inference_client
from rollflow.launch.server_group import ServerGroup
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.held_runs import start_paused, wait_for
from .helpers.processes import descendants, still_running, wait_dead
from .helpers.waits import wait_until_sync

pytestmark = pytest.mark.http_only(reason="managed HTTP servers are what dies")

REQUEST = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=2))


def _servers_of_this_process() -> list[int]:
    return [child for child, (_, cmd) in descendants(os.getpid()).items() if "rollflow serve" in cmd]


def managed_config(tmp_path: Path):
    return build_config(
        {
            "output_dir": str(tmp_path),
            "inference": {"mode": "http", "num_servers": 1, "max_batch_size": 4, "check_logprobs": False},
        }
    )


async def test_a_killed_managed_server_is_named_with_its_pid_signal_and_log(tmp_path) -> None:
    config = managed_config(tmp_path)
    log_path = config.run_dir / "logs" / "inference" / "server-0.log"
    # Servers this process had already (session fixtures' shared servers) are not this test's.
    before = set(_servers_of_this_process())
    with pytest.raises(ServerDiedError) as caught:
        async with get_inference_client(config) as client:
            url = client.server_urls[0]
            assert len((await client.generate(REQUEST)).token_ids) == 2
            (pid,) = set(_servers_of_this_process()) - before
            os.kill(pid, signal.SIGKILL)
            assert wait_dead([pid]) == []
            await client.generate(REQUEST)
    message = str(caught.value)
    assert f"server 0 ({url}, pid {pid}) was killed by SIGKILL (signal 9)" in message, message
    assert f"log {log_path}" in message
    # The log's last lines come with it (the server logs its ready line when it starts).
    last_line = log_path.read_text().splitlines()[-1]
    assert last_line in message
    # The call that failed is still named, and is the cause.
    assert isinstance(caught.value.__cause__, RemoteInferenceError)
    assert f"the call that failed: {type(caught.value.__cause__).__name__}" in message
    assert caught.value.deaths and len(caught.value.deaths) == 1


async def test_an_error_with_every_server_alive_is_left_as_it_is(tmp_path) -> None:
    with pytest.raises(ValueError, match="not about the server"):
        async with ServerGroup("rollflow:tiny", 1, tmp_path) as group:
            assert group.urls
            raise ValueError("not about the server")


async def test_a_server_that_exits_by_itself_is_named_with_its_exit_code(tmp_path) -> None:
    with pytest.raises(ServerDiedError) as caught:
        async with ServerGroup("rollflow:tiny", 1, tmp_path) as group:
            url, pid = group.urls[0], group.pids[0]
            # SIGTERM to the server alone: it stops by itself, and exits with a code rather than by a signal.
            os.kill(pid, signal.SIGTERM)
            assert wait_dead([pid]) == []
            raise RuntimeError("the call that saw it go")
    (death,) = caught.value.deaths
    assert death.startswith(f"server 0 ({url}, pid {pid}) exited with code "), death
    assert f"log {tmp_path / 'server-0.log'}" in death
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "the call that failed: RuntimeError: the call that saw it go" in str(caught.value)


@pytest.mark.slow
def test_rollflow_run_names_the_server_that_was_killed_mid_run(tmp_path) -> None:
    process, marker = start_paused(
        tmp_path,
        "setup",
        "--set",
        "inference.num_servers=1",
        env={"ROLLFLOW_INFERENCE_MODE": "http"},
        hold_s=300,
    )
    try:
        wait_for(marker, process)  # servers up, the first weight update about to go out
        children = descendants(process.pid)
        (pid,) = [child for child, cmd in still_running(children).items() if "rollflow serve" in cmd]
        os.kill(pid, signal.SIGKILL)
        assert wait_dead([pid]) == []
        marker.with_name(marker.name + ".release").write_text("")
        _, stderr = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    print(stderr[stderr.index("error: ") :])
    log_path = Path("runs") / "quickstart" / "logs" / "inference" / "server-0.log"
    assert f", pid {pid}) was killed by SIGKILL (signal 9); log " in stderr, stderr[-3000:]
    assert str(log_path) in stderr or str(tmp_path / log_path) in stderr, stderr[-3000:]
    assert "the call that failed:" in stderr
    assert "Traceback" not in stderr
    wait_until_sync(lambda: not still_running(children), lambda: f"left: {still_running(children)}")


def test_a_child_whose_main_thread_is_gone_while_others_tear_down_counts_as_exited() -> None:
    """The state a SIGKILLed server is in while its threads still tear down (seen on a busy machine): its main
    thread a zombie, the process not yet reapable (``waitid`` reports nothing). Here the main thread leaves
    by ``pthread_exit`` while another thread sleeps, which holds that state for as long as the sleep."""
    import subprocess
    import sys
    import time

    from rollflow.launch.local import _has_exited

    script = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        wait_until_sync(
            lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the main thread is a zombie"
        )
        time.sleep(0.2)
        assert os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        assert _has_exited(child.pid)
    finally:
        child.kill()
        child.wait()
    assert _has_exited(child.pid)  # reaped
