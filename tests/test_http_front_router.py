"""The router's hot path (``rollflow.http.front``) over real loopback sockets: requests that name
their session in ``X-Session-ID`` are served by ``HttpFront``; everything else on the same connection is
handed to aiohttp; limits, failover, streaming and disconnects behave as on aiohttp's path."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from rollflow.errors import ENGINE_DEAD_TYPE, error_body
from rollflow.http.limits import HttpLimits
from rollflow.inference.router import WORKER_HEADER, InferenceRouter

from .helpers.raw_http import exchange
from .helpers.waits import wait_until

pytestmark = pytest.mark.asyncio


class Backend:
    """A small engine stand-in: echoes what it got, or streams, or dies, or hangs, as a test asks."""

    def __init__(self, mode: str = "echo"):
        self.mode = mode
        self.received: list[dict] = []
        self.cancelled = asyncio.Event()
        self.url = ""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            {"headers": dict(request.headers), "body": body.decode(), "path": request.path_qs}
        )
        if self.mode == "dead":
            return web.json_response(error_body(503, "engine died", type=ENGINE_DEAD_TYPE), status=503)
        if self.mode == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.mode == "stream":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for index in range(3):
                await response.write(f"data: {index}\n\n".encode())
                await asyncio.sleep(0.02)
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"echo": json.loads(body), "path": request.path_qs})

    async def __aenter__(self) -> Backend:
        app = web.Application()
        for path in ("/inference/v1/generate", "/v1/completions"):
            app.router.add_post(path, self.generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._runner.cleanup()


def generate_request(
    body: bytes = b'{"token_ids": [1]}', session: str | None = "s1", extra: bytes = b""
) -> bytes:
    session_line = b"X-Session-ID: %s\r\n" % session.encode() if session else b""
    return (
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        + session_line
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def open_router(router: InferenceRouter):
    host, port = router.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_hot_path_then_handoff_on_one_kept_alive_connection():
    async with Backend() as backend, InferenceRouter([backend.url], health_check_interval_s=60) as router:
        reader, writer = await open_router(router)
        for turn in range(3):
            status, headers, body = await exchange(
                reader, writer, generate_request(b'{"turn": %d}' % turn, extra=b"X-Custom: kept\r\n")
            )
            assert status == 200 and headers[WORKER_HEADER.lower()] == backend.url
            assert json.loads(body)["echo"] == {"turn": turn}
        assert len(router.fronts) == 1  # served by the front so far
        assert backend.received[-1]["headers"]["X-Custom"] == "kept"
        assert backend.received[-1]["headers"]["X-Session-ID"] == "s1"
        # A request without the session header: handed to aiohttp (which decodes the body), same connection.
        status, headers, body = await exchange(
            reader, writer, generate_request(b'{"session_id": "s2"}', None)
        )
        assert status == 200 and json.loads(body)["echo"] == {"session_id": "s2"}
        assert not router.fronts
        status, _, body = await exchange(reader, writer, b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        assert status == 200 and b"rollflow_router_requests_total 4" in body
        writer.close()


async def test_hot_path_streams_chunks_and_answers_unknown_paths_via_aiohttp():
    async with (
        Backend("stream") as backend,
        InferenceRouter([backend.url], health_check_interval_s=60) as router,
    ):
        reader, writer = await open_router(router)
        status, headers, body = await exchange(reader, writer, generate_request(b'{"stream": true}'))
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        status, _, body = await exchange(
            reader, writer, b"POST /nowhere HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n"
        )
        assert status == 404 and "error" in json.loads(body)
        writer.close()


async def test_hot_path_fails_over_from_a_dead_engine():
    async with Backend("dead") as dead, Backend() as alive:
        async with InferenceRouter([dead.url, alive.url], health_check_interval_s=60) as router:
            reader, writer = await open_router(router)
            # Sessions land on both servers by hashing: every one of them must be answered by the live one.
            for index in range(8):
                status, headers, _ = await exchange(reader, writer, generate_request(session=f"s{index}"))
                assert status == 200 and headers[WORKER_HEADER.lower()] == alive.url
            assert dead.received and router.num_dead_engines == 1
            assert not router.workers[dead.url].healthy
            writer.close()
        # Every engine dead: 503 EngineDeadError from the router itself.
        async with InferenceRouter([dead.url], health_check_interval_s=60) as router:
            reader, writer = await open_router(router)
            status, _, body = await exchange(reader, writer, generate_request())
            assert status == 503 and json.loads(body)["error"]["type"] == ENGINE_DEAD_TYPE
            writer.close()


async def test_hot_path_keeps_the_limits():
    limits = HttpLimits(header_timeout_s=0.3, body_timeout_s=0.3, max_connections=2)
    async with (
        Backend() as backend,
        InferenceRouter(
            [backend.url], health_check_interval_s=60, http_limits=limits, max_body_bytes=100
        ) as router,
    ):
        # A body that stops arriving: 408 naming body_timeout_s.
        reader, writer = await open_router(router)
        writer.write(generate_request(b'{"token_ids": [1, 2, 3]}')[:-5])
        raw = await asyncio.wait_for(reader.read(), 60)
        assert raw.split(b" ")[1] == b"408" and b"body_timeout_s" in raw
        writer.close()
        # A head that stops arriving: 408 naming header_timeout_s.
        reader, writer = await open_router(router)
        writer.write(b"POST /inference/v1/generate HTTP/1.1\r\nX-Sess")
        raw = await asyncio.wait_for(reader.read(), 60)
        assert raw.split(b" ")[1] == b"408" and b"header_timeout_s" in raw
        writer.close()
        # A body over max_body_bytes: 413 (aiohttp's answer, as before).
        reader, writer = await open_router(router)
        status, _, body = await exchange(reader, writer, generate_request(b'{"x": "%s"}' % (b"y" * 200)))
        assert status == 413 and "error" in json.loads(body)
        writer.close()
        # Connections over max_connections (those handed to aiohttp count too): 503.
        held = [await open_router(router) for _ in range(2)]
        status, _, _ = await exchange(*held[0], b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert status == 200 and len(router.fronts) == 1
        reader, writer = await open_router(router)
        raw = await asyncio.wait_for(reader.read(), 60)
        assert raw.split(b" ")[1] == b"503" and b"max_connections" in raw
        for _, held_writer in held:
            held_writer.close()
        writer.close()


async def test_hot_path_checks_the_api_key_and_forwards_it():
    async with (
        Backend() as backend,
        InferenceRouter([backend.url], health_check_interval_s=60, api_key="sekret") as router,
    ):
        reader, writer = await open_router(router)
        status, _, body = await exchange(
            reader, writer, generate_request(extra=b"Authorization: Bearer no\r\n")
        )
        assert status == 401 and "error" in json.loads(body)
        writer.close()
        reader, writer = await open_router(router)
        auth = b"Authorization: Bearer sekret\r\n"
        status, _, _ = await exchange(reader, writer, generate_request(extra=auth))
        assert status == 200 and backend.received[-1]["headers"]["Authorization"] == "Bearer sekret"
        writer.close()


async def test_caller_that_leaves_cancels_the_upstream_request():
    async with (
        Backend("hang") as backend,
        InferenceRouter([backend.url], health_check_interval_s=60) as router,
    ):
        _, writer = await open_router(router)
        writer.write(generate_request())
        await writer.drain()
        await wait_until(lambda: backend.received, "the request reaches the backend")
        writer.close()
        await asyncio.wait_for(backend.cancelled.wait(), 60)
        assert router.workers[backend.url].outstanding == 0


async def test_odd_heads_are_left_to_aiohttp():
    async with Backend() as backend, InferenceRouter([backend.url], health_check_interval_s=60) as router:
        # The session named twice: aiohttp's path serves it, with the first.
        reader, writer = await open_router(router)
        status, _, _ = await exchange(reader, writer, generate_request(extra=b"X-Session-ID: other\r\n"))
        assert status == 200 and not router.fronts and router._sessions.get("s1") == backend.url
        writer.close()
        # A bare line feed inside the head: never forwarded as it is.
        forwarded = len(backend.received)
        reader, writer = await open_router(router)
        writer.write(generate_request(extra=b"X-A: b\nContent-Length: 1000\r\n"))
        await writer.drain()
        await asyncio.wait_for(reader.read(1), 60)  # whatever aiohttp answers, the front did not forward it
        assert not router.fronts and len(backend.received) == forwarded
        writer.close()
