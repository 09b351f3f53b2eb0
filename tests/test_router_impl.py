"""Both routers rollflow can start (``inference.router_impl``): session affinity, failover and the control plane.

rollflow's router and vllm-router (``--policy consistent_hash``) run over real ``rollflow serve`` servers; which
server answered is read from the servers' own request counters (``vllm:request_success`` in ``/metrics``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal

import aiohttp
import pytest

from rollflow.errors import InferenceError, MissingExtraError
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.launch.router_process import RouterProcess, VllmRouterProcess
from rollflow.launch.server_group import ServerGroup
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.servers import server_metric
from .helpers.waits import wait_until

HAS_VLLM_ROUTER = importlib.util.find_spec("vllm_router") is not None
IMPLS = [
    "rollflow",
    pytest.param(
        "vllm-router", marks=pytest.mark.skipif(not HAS_VLLM_ROUTER, reason="pip install vllm-router")
    ),
]


def start_router(impl: str, urls: list[str], log_dir, interval_s: float):
    if impl == "vllm-router":
        return VllmRouterProcess(urls, log_dir, health_check_interval_s=interval_s, startup_timeout_s=60)
    return RouterProcess(urls, log_dir, health_check_interval_s=interval_s, startup_timeout_s=60)


async def finished_requests(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    line = next(line for line in text.splitlines() if line.startswith("vllm:request_success"))
    return int(float(line.split()[-1]))


def request(session_id: str | None, max_tokens: int = 2) -> GenerateRequest:
    return GenerateRequest([5, 6, 7], SamplingParams(max_tokens=max_tokens), session_id=session_id)


@pytest.mark.parametrize("impl", IMPLS)
async def test_sessions_stick_to_one_server_and_spread(impl, inference_servers, tmp_path):
    urls = inference_servers.urls
    # A long interval: rollflow's health probes generate a token, which would count on the servers.
    async with (
        start_router(impl, urls, tmp_path, interval_s=600) as router,
        RemoteInferenceClient(router.url, urls) as client,
        aiohttp.ClientSession() as http,
    ):
        owners = set()
        for index in range(10):
            before = [await finished_requests(http, url) for url in urls]
            for _ in range(3):
                assert len((await client.generate(request(f"sticky-{index}"))).token_ids) == 2
            after = [await finished_requests(http, url) for url in urls]
            deltas = [a - b for a, b in zip(after, before, strict=True)]
            assert sorted(deltas) == [0, 3], f"session sticky-{index} was split across servers: {deltas}"
            owners.add(deltas.index(3))
        assert owners == {0, 1}, "every session landed on one server"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
async def test_a_killed_server_leaves_and_sessions_carry_on(impl, inference_servers, tmp_path):
    async with ServerGroup("rollflow:tiny", 1, tmp_path / "extra", startup_timeout_s=120) as extra:
        victim_pid = extra.pids[0]
        urls = [inference_servers.urls[0], extra.urls[0]]
        async with (
            start_router(impl, urls, tmp_path, interval_s=1.0) as router,
            RemoteInferenceClient(
                router.url, urls, request_timeout_s=60, drop_unreachable_servers=True
            ) as client,
        ):
            sessions = [f"failover-{index}" for index in range(16)]
            outputs = await asyncio.gather(*(client.generate(request(sid)) for sid in sessions))
            assert all(len(output.token_ids) == 2 for output in outputs)
            os.killpg(victim_pid, signal.SIGKILL)

            async def answers() -> list | None:
                outputs = await asyncio.gather(
                    *(client.generate(request(sid)) for sid in sessions), return_exceptions=True
                )
                if any(isinstance(output, InferenceError) for output in outputs):
                    return None  # the router's health checks (every second) have not taken the dead one out
                return outputs

            # Every session, those that were on the dead server included, is answered by the one left.
            outputs = await wait_until(answers, "every session is answered by the server left", poll_s=0.5)
            assert all(len(output.token_ids) == 2 for output in outputs)
            # The control plane, the client's own, carries on with the server that is left.
            await client.pause("keep")
            await client.resume()
            assert client.server_urls == [inference_servers.urls[0]]


@pytest.mark.parametrize("impl", IMPLS)
async def test_setup_starts_the_router_and_the_client_fans_control_calls_out(
    impl, inference_servers, tmp_path
):
    from rollflow.config import build_config
    from rollflow.inference.setup import get_inference_client

    urls = inference_servers.urls
    config = build_config(
        {
            "output_dir": str(tmp_path),
            "inference": {
                "mode": "http",
                "router_port": 0,
                "router_impl": impl,
                "external_server_urls": urls,
                "health_check_interval_s": 1.0,
            },
        }
    )
    async with get_inference_client(config) as client:
        assert isinstance(client, RemoteInferenceClient)
        assert client.data_url not in urls and client.server_urls == urls
        assert await client.get_world_size() == 2  # asked from each server, summed
        await client.pause("keep")
        try:
            assert await client.is_paused()
            # A request sent while paused waits, and finishes after resume.
            pending = asyncio.create_task(client.generate(request("paused-session")))

            async def queued() -> bool:
                return await server_metric(urls, "vllm:num_requests_waiting") > 0

            await wait_until(queued, "the request waits on a paused server", poll_s=0.02)
            assert not pending.done()
        finally:
            await client.resume()
        assert len((await pending).token_ids) == 2
        assert not await client.is_paused()
        await client.finish_session("paused-session")  # vllm-router does not know it: logged, not raised
    assert (config.run_dir / "logs" / "inference" / "router-0.log").exists()


def test_vllm_router_missing_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm_router" else real_find_spec(name, *a),
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'rollflow\[vllm-router\]'"):
        VllmRouterProcess(["http://127.0.0.1:9"], tmp_path)._command()


def test_vllm_router_command(tmp_path):
    if not HAS_VLLM_ROUTER:
        pytest.skip("pip install vllm-router")
    with pytest.raises(ValueError, match="at least one server"):
        VllmRouterProcess([], tmp_path)
    command, env, port = VllmRouterProcess(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"], tmp_path, health_check_interval_s=0.5
    )._command()
    assert command[command.index("--policy") + 1] == "consistent_hash"
    assert command[command.index("--health-check-interval-secs") + 1] == "1"  # whole seconds, at least 1
    assert "http://127.0.0.1:10" in command and port > 0 and env == {"RUST_LOG": "warn"}
    # Its metrics exporter gets a free port of its own (the default, 29000, would clash between two routers).
    assert int(command[command.index("--prometheus-port") + 1]) not in (0, 29000, port)
