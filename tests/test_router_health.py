"""The router's health checks beyond a refused connection: a server whose generation hangs while its
``/health`` answers is taken out and the requests in flight to it fail over; a paused one is not; one that was
down during a weight update stays out until it serves the fleet's policy version.

A hung engine cannot be produced with a real ``rollflow serve`` (its HTTP loop and its engine share the
process, and nothing wedges one without the other), so small aiohttp backends stand in for the hung,
paused and stale servers; the healthy server is a real one.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from rollflow.inference.router import HUNG_PROBES, WORKER_HEADER, InferenceRouter

from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="the router's health checks against servers"),
]

# ignore_eos: the 2-token reply's length is asserted, and a sampled end-of-sequence token would end it at one.
GENERATE = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, "ignore_eos": True}}


class FakeServer:
    """A server double: ``/health`` answers; ``/inference/v1/generate`` hangs while ``hung``, else answers
    one token; ``/is_paused`` and ``/weight_info`` report ``paused`` and ``version``."""

    def __init__(self, *, hung: bool = False, paused: bool = False, version: str = "0"):
        self.hung = hung
        self.paused = paused
        self.version = version
        self.generate_calls = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.Response:
        self.generate_calls += 1
        while self.hung:
            await asyncio.sleep(0.05)
        return web.json_response({"choices": [{"token_ids": [1], "finish_reason": "length"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_post("/inference/v1/generate", self._generate)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.hung = False
        assert self._runner is not None
        await self._runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_hung_server_is_taken_out_and_its_requests_fail_over(inference_servers, http):
    real = inference_servers.urls[0]
    async with (
        FakeServer(hung=True) as hung,
        # A probe timeout far above a real generation's on a busy machine: only the hung server misses it.
        InferenceRouter([hung.url], health_check_interval_s=0.2, health_check_timeout_s=5.0) as router,
    ):
        # The only server is the hung one: the request goes there and waits.
        started = time.monotonic()
        in_flight = asyncio.create_task(
            http.post(f"{router.url}/inference/v1/generate", json=GENERATE, headers={"X-Session-ID": "s1"})
        )
        await wait_until(lambda: hung.generate_calls >= 1, "the request reaches the hung server")
        router.add_worker(real)
        await wait_until(lambda: not router.workers[hung.url].healthy, "the hung server is taken out")
        async with await in_flight as response:
            assert response.status == 200, await response.text()
            assert response.headers[WORKER_HEADER] == real  # failed over, not waiting request_timeout_s
            assert len((await response.json())["choices"][0]["token_ids"]) == 2
        assert time.monotonic() - started < 60  # request_timeout_s is 600 s
        assert router.num_retries >= 1
        # /health on the hung server still answers: only the generation probe could tell.
        async with http.get(f"{hung.url}/health") as response:
            assert response.status == 200
        # New sessions avoid it.
        for index in range(4):
            async with http.post(
                f"{router.url}/inference/v1/generate", json=GENERATE, headers={"X-Session-ID": f"n{index}"}
            ) as response:
                assert response.status == 200 and response.headers[WORKER_HEADER] == real
        # It rejoins once its generation works again.
        hung.hung = False
        await wait_until(lambda: router.workers[hung.url].healthy, "the recovered server rejoins")


async def test_a_paused_server_whose_probes_queue_stays_in():
    async with (
        FakeServer(hung=True, paused=True) as paused,
        InferenceRouter([paused.url], health_check_interval_s=0.1, health_check_timeout_s=0.3) as router,
    ):
        # Several timed-out probes (HUNG_PROBES of them would take a hung server out).
        await wait_until(
            lambda: paused.generate_calls >= HUNG_PROBES + 2, "probes time out on the paused server"
        )
        assert router.workers[paused.url].healthy
        assert router.workers[paused.url].hung_probes == 0


async def test_a_server_back_from_a_missed_weight_update_stays_out_until_it_matches():
    async with (
        FakeServer(version="3") as current,
        FakeServer(version="0", hung=True) as behind,
        InferenceRouter(
            [current.url, behind.url], health_check_interval_s=0.1, health_check_timeout_s=0.3
        ) as router,
    ):
        await wait_until(lambda: not router.workers[behind.url].healthy, "the hung server is taken out")
        # It answers again, but serves policy version 0 while the fleet serves 3.
        behind.hung = False
        await wait_until(lambda: router.workers[behind.url].stale is not None, "the stale server is kept out")
        row = next(row for row in router.worker_table() if row["url"] == behind.url)
        assert not row["healthy"]
        assert "serves policy version 0 and the servers in rotation 3" in row["stale"]
        await asyncio.sleep(0.5)  # more probes succeed; it stays out
        assert not router.workers[behind.url].healthy
        # Weights pushed to it again: it rejoins.
        behind.version = "3"
        await wait_until(lambda: router.workers[behind.url].healthy, "the updated server rejoins")
        assert router.workers[behind.url].stale is None
