"""``RouterProcess``: the router rollflow starts runs as ``rollflow router`` in a subprocess."""

from __future__ import annotations

import socket

import pytest

from rollflow.launch.router_process import RouterProcess
from rollflow.launch.server_group import ServerStartError


def test_needs_servers_and_keeps_the_key_off_the_command_line(tmp_path):
    with pytest.raises(ValueError, match="at least one server"):
        RouterProcess([], tmp_path)
    command, env, port = RouterProcess(["http://127.0.0.1:9"], tmp_path, api_key="s3cret")._command()
    assert "s3cret" not in " ".join(command) and env == {"ROLLFLOW_API_KEY": "s3cret"} and port is None
    # Without a key the router gets none, even if this process has one in its environment.
    assert RouterProcess(["http://127.0.0.1:9"], tmp_path)._command()[1] == {"ROLLFLOW_API_KEY": ""}


async def test_a_taken_port_fails_naming_the_router_and_quoting_its_log(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        router = RouterProcess(["http://127.0.0.1:9"], tmp_path, port=port, startup_timeout_s=60)
        with pytest.raises(ServerStartError, match=r"router 0 exited") as error:
            await router.start()
    assert "router-0.log" in str(error.value) and str(port) in str(error.value)
    assert router.pids == []  # nothing left running


@pytest.mark.http_only(reason="the router process over the shared servers")
async def test_routes_to_its_servers_and_stops(tmp_path, inference_servers):
    import aiohttp

    from .helpers.processes import wait_dead

    async with RouterProcess(inference_servers.urls, tmp_path, health_check_interval_s=0.5) as router:
        pids = router.pids
        async with aiohttp.ClientSession() as http, http.get(f"{router.url}/list_workers") as response:
            assert response.status == 200
            workers = (await response.json())["workers"]
    assert sorted(worker["url"] for worker in workers) == sorted(inference_servers.urls)
    assert wait_dead(pids, timeout_s=60) == []
