"""InferenceRouter over real ``rollflow serve`` servers: affinity, balancing, bad input, failover, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from rollflow.errors import error_code
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import WORKER_HEADER, InferenceRouter
from rollflow.launch.server_group import ServerGroup, free_port
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="the router's own routing, admin and failure handling"),
]

GENERATE = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}


@pytest.fixture(scope="module")
def servers(inference_servers):
    return inference_servers


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(servers):
    async with InferenceRouter(servers.urls, health_check_interval_s=0.5, max_body_bytes=64 * 1024) as router:
        yield router


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http, url, body=None, **kwargs):
    async with http.post(url, json=body, **kwargs) as response:
        return response.status, await response.json(), response.headers.get(WORKER_HEADER)


async def test_sessions_stick_and_spread(router, http):
    owners: dict[str, set[str]] = {}
    for turn in range(3):
        for index in range(12):
            session_id = f"session-{index}"
            # Turn 0 names the session in the header, later turns in the body: both pin it.
            if turn == 0:
                status, _, worker = await post(
                    http,
                    f"{router.url}/inference/v1/generate",
                    GENERATE,
                    headers={"X-Session-ID": session_id},
                )
            else:
                status, _, worker = await post(
                    http, f"{router.url}/inference/v1/generate", {**GENERATE, "session_id": session_id}
                )
            assert status == 200
            owners.setdefault(session_id, set()).add(worker)
    assert all(len(workers) == 1 for workers in owners.values()), owners
    # Bounded loads: 12 new sessions over 2 servers, 6 each (the only sessions this router pins).
    placed = [next(iter(workers)) for workers in owners.values()]
    assert sorted(placed.count(url) for url in set(placed)) == [6, 6], owners
    async with http.get(f"{router.url}/metrics") as response:
        metrics = await response.text()
    gauges = [line for line in metrics.splitlines() if line.startswith("rollflow_router_worker_sessions{")]
    assert sorted(gauges) == sorted(
        f'rollflow_router_worker_sessions{{worker="{url}"}} {placed.count(url)}' for url in set(placed)
    )
    status, body, _ = await post(http, f"{router.url}/finish_session?session_id=session-0")
    assert (status, body["found"]) == (200, True)
    status, body, _ = await post(http, f"{router.url}/finish_session?session_id=session-0")
    assert (status, body["found"]) == (200, False)


async def test_requests_without_session_go_to_the_least_loaded(router, http):
    results = await asyncio.gather(
        *(post(http, f"{router.url}/inference/v1/generate", GENERATE) for _ in range(16))
    )
    assert all(status == 200 for status, _, _ in results)
    assert len({worker for _, _, worker in results}) == 2


async def test_admin_and_observability_endpoints(router, servers, http):
    async with http.get(f"{router.url}/health") as response:
        assert response.status == 200 and (await response.json())["healthy_workers"] == 2
    async with http.get(f"{router.url}/list_workers") as response:
        workers = (await response.json())["workers"]
    assert {row["url"] for row in workers} == set(servers.urls)
    async with http.get(f"{router.url}/metrics") as response:
        text = await response.text()
    assert "rollflow_router_requests_total" in text and 'worker_healthy{worker="' in text
    async with http.get(f"{router.url}/v1/models") as response:
        assert response.status == 200 and (await response.json())["object"] == "list"
    extra = servers.urls[0].replace("127.0.0.1", "localhost")
    assert (await post(http, f"{router.url}/add_worker?url={extra}"))[1]["status"] == "added"
    assert (await post(http, f"{router.url}/add_worker", {"url": extra}))[1]["status"] == "exists"
    assert (await post(http, f"{router.url}/remove_worker?url={extra}"))[0] == 200
    assert len(router.workers) == 2


BAD_REQUESTS = [
    # (path, raw body or JSON, expected status)
    ("/inference/v1/generate", b"{not json", 400),
    ("/inference/v1/generate", b"[1, 2]", 400),
    ("/inference/v1/generate", {"token_ids": [1], "session_id": 7}, 400),
    ("/inference/v1/generate", {"sampling_params": {"max_tokens": 2}}, 400),
    ("/inference/v1/generate", {"token_ids": "abc"}, 400),
    ("/inference/v1/generate", {"token_ids": [10**9]}, 400),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": -1}}, 400),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 10**12}}, 400),
    ("/inference/v1/generate", b"x" * (65 * 1024), 413),
    ("/v1/completions", {"prompt": [1], "max_tokens": "many"}, 400),
    ("/no/such/path", {}, 404),
    ("/add_worker", {}, 400),
    ("/add_worker?url=ftp://host:1", None, 400),
    ("/add_worker?url=http://host:99999", None, 400),
    ("/remove_worker?url=http://127.0.0.1:1", None, 404),
    ("/finish_session", None, 400),
    ("/finish_session", b"{", 400),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS)
async def test_bad_input_gets_a_4xx_json_error(router, http, path, body, status):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{router.url}{path}", **kwargs) as response:
        assert response.status == status, await response.text()
        error = (await response.json())["error"]
    assert error["code"] == error_code(status) and error["message"] and error["type"]
    assert (await post(http, f"{router.url}/inference/v1/generate", GENERATE))[0] == 200


async def test_wrong_method_and_bad_content_length(router, http):
    async with http.get(f"{router.url}/inference/v1/generate") as response:
        assert response.status == 405 and "error" in await response.json()
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: banana\r\n\r\n{}"
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"400"
    assert json.loads(payload)["error"]["code"] == "invalid_request"
    assert (await post(http, f"{router.url}/inference/v1/generate", GENERATE))[0] == 200


async def test_streaming_passes_through(http):
    # A small SSE backend (vLLM-like) with chosen pauses between events stands in for an engine server here.
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(3):
            await response.write(f"data: {index}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with InferenceRouter([backend], health_check_interval_s=60) as router:
            chunks = []
            async with http.post(f"{router.url}/v1/completions", json={"stream": True}) as response:
                assert response.headers["Content-Type"].startswith("text/event-stream")
                async for line in response.content:
                    if line.strip():
                        chunks.append(line.strip())
            assert chunks == [b"data: 0", b"data: 1", b"data: 2", b"data: [DONE]"]
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_killed_server_is_taken_out_and_requests_keep_succeeding(servers, tmp_path):
    interval = 0.5
    async with ServerGroup("rollflow:tiny", 1, tmp_path, startup_timeout_s=120) as extra:
        victim_pid, victim_url = extra.pids[0], extra.urls[0]
        urls = [servers.urls[0], victim_url]
        async with InferenceRouter(urls, health_check_interval_s=interval) as router:
            client = RemoteInferenceClient(
                router.url, urls, request_timeout_s=60, drop_unreachable_servers=True
            )
            async with client:

                async def one(index: int):
                    sampling = SamplingParams(max_tokens=8)
                    return await client.generate(
                        GenerateRequest([5, 6, 7], sampling, session_id=f"s{index % 20}")
                    )

                load = [asyncio.create_task(one(index)) for index in range(200)]
                deadline = time.monotonic() + 30  # a loaded machine may take a while to send the first ones
                while router.workers[victim_url].requests == 0:
                    assert time.monotonic() < deadline, "no request reached the server about to be killed"
                    await asyncio.sleep(0.05)
                os.killpg(victim_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await wait_until(
                    lambda: not router.workers[victim_url].healthy, "the killed server is taken out"
                )
                taken_out_s = time.monotonic() - killed_at
                outputs = await asyncio.gather(*load)
                assert all(len(output.token_ids) == 8 for output in outputs)
                after = await asyncio.gather(*(one(index) for index in range(20)))
                assert all(len(output.token_ids) == 8 for output in after)
                # The control plane carries on with the server that is left.
                await client.pause("keep")
                await client.resume()
                assert client.server_urls == [servers.urls[0]]
            # Within about one health-check interval; generous, for a loaded machine.
            assert taken_out_s <= interval + 10, f"took {taken_out_s:.2f} s to take the dead server out"
            assert [row["sessions"] for row in router.worker_table() if row["url"] == victim_url] == [0]


async def test_router_cli_prints_ready_line_and_proxies():
    dead_server = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "rollflow", "router", "--server", dead_server, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        event = json.loads(process.stdout.readline())
        assert event["event"] == "ready" and event["url"].startswith("http://127.0.0.1:")
        import urllib.request

        with urllib.request.urlopen(f"{event['url']}/list_workers", timeout=10) as response:
            assert json.load(response)["workers"][0]["url"] == dead_server
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) in (0, 130)
    finally:
        process.kill()
        process.wait()
    bad = subprocess.run(
        [sys.executable, "-m", "rollflow", "router", "--server", "not-a-url"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not-a-url" in bad.stderr
