"""ServerGroup: command lines, start-up, logs, and teardown that leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import aiohttp
import pytest

from rollflow.errors import RollflowError
from rollflow.launch.server_group import (
    ServerGroup,
    ServerStartError,
    build_torch_server_command,
    build_vllm_server_command,
)

from .helpers.processes import process_alive, wait_dead
from .helpers.waits import wait_until


def test_server_start_error_is_a_rollflow_error():
    assert issubclass(ServerStartError, RollflowError)


def test_vllm_command_line_not_colocated():
    argv, env = build_vllm_server_command(
        "Qwen/Qwen3-0.6B",
        port=8123,
        served_model_name="policy",
        tensor_parallel_size=2,
        data_parallel_size=4,
        max_model_len=4096,
        max_num_seqs=256,
    )
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--served-model-name"] == "policy"
    assert flags["--tensor-parallel-size"] == "2" and flags["--data-parallel-size"] == "4"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "--enable-scale-out" in argv  # /inference/v1/generate is off by default in vLLM 0.33
    assert "--enable-sleep-mode" not in argv
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--max-num-seqs") + 1] == "256"
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_vllm_command_line_colocated():
    argv, env = build_vllm_server_command("m", port=1, colocate=True, extra_args=["--seed", "3"])
    assert "--enable-sleep-mode" in argv
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "ipc"}
    assert argv[argv.index("--served-model-name") + 1] == "m"
    assert argv[-2:] == ["--seed", "3"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    argv, _ = build_vllm_server_command("m", port=1, colocate=True, weight_transfer_backend="nccl")
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}


def test_torch_command_line():
    argv, _ = build_torch_server_command("rollflow:tiny", port=0, max_batch_size=8, max_model_len=256)
    assert argv[:4] == [sys.executable, "-m", "rollflow", "serve"]
    assert argv[argv.index("--model") + 1] == "rollflow:tiny"
    assert argv[argv.index("--port") + 1] == "0"
    assert argv[argv.index("--max-batch-size") + 1] == "8"


async def test_group_serves_and_logs_each_server(inference_servers):
    assert len(inference_servers.urls) == 2 and len(set(inference_servers.urls)) == 2
    async with aiohttp.ClientSession() as session:
        for url in inference_servers.urls:
            async with session.get(f"{url}/health") as response:
                assert response.status == 200
    for index in range(2):
        log = (inference_servers.log_dir / f"server-{index}.log").read_text()
        assert "rollflow serve" in log and '"event": "ready"' in log


async def test_cancelled_start_leaves_nothing(tmp_path):
    group = ServerGroup("rollflow:tiny", 2, tmp_path, startup_timeout_s=120)
    starting = asyncio.create_task(group.start())
    await wait_until(lambda: len(group.pids) == 2, "both server processes are started", poll_s=0.05)
    pids = list(group.pids)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert group.pids == []
    assert wait_dead(pids, timeout_s=60) == []


@pytest.mark.slow
async def test_failed_start_names_the_log_and_leaves_nothing(tmp_path):
    group = ServerGroup("/no/such/model", 1, tmp_path, startup_timeout_s=120)
    with pytest.raises(ServerStartError, match="exited with code") as info:
        await group.start()
    assert "server-0.log" in str(info.value)
    assert group.pids == []


async def test_startup_timeout_kills_the_servers(tmp_path):
    group = ServerGroup("rollflow:tiny", 1, tmp_path, startup_timeout_s=0.3)
    with pytest.raises(ServerStartError, match="startup_timeout_s"):
        await group.start()
    assert group.pids == []


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from rollflow.launch.server_group import ServerGroup

    async def main():
        async with ServerGroup("rollflow:tiny", 1, sys.argv[1], startup_timeout_s=120) as group:
            print("server-pid", group.pids[0], flush=True)
            await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("parent_signal", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_no_orphans_when_the_parent_is_interrupted_or_killed(tmp_path, parent_signal):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = iter(parent.stdout.readline, "")  # structlog's default logger also writes to stdout
        line = next((line for line in lines if line.startswith("server-pid ")), "")
        assert line, "the parent exited before its server was ready"
        server_pid = int(line.split()[1])
        assert process_alive(server_pid)
        os.kill(parent.pid, parent_signal)
        parent.wait(timeout=30)
        assert wait_dead([server_pid]) == [], f"server {server_pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
