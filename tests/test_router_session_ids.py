"""The router's session ids: bounded before anything is pinned, one decoding on both front paths (the raw
fast path serves a Content-Length body, aiohttp a chunked one), and no pin for a request the server refused.

The upstream is a stub aiohttp app (the router only proxies; no model is needed)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from rollflow.inference.router import InferenceRouter
from rollflow.inference.session_ids import MAX_SESSION_ID_BYTES
from rollflow.launch.server_group import free_port

from .helpers.raw_http import exchange

pytestmark = pytest.mark.http_only(reason="the router's front paths, byte for byte")

PATH = "/inference/v1/generate"


@pytest_asyncio.fixture
async def upstream():
    """A stub server: 400 for a body with ``"refuse": true``, else 200; records what reached it."""
    seen: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("request_id") != "router-health":
            seen.append(body)
        if body.get("refuse"):
            return web.json_response({"error": {"message": "refused", "type": "BadRequestError"}}, status=400)
        return web.json_response({"choices": [{"token_ids": [1]}]})

    app = web.Application()
    app.router.add_post(PATH, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def router(upstream):
    async with InferenceRouter([upstream[0]], health_check_interval_s=3600.0) as router:
        yield router


def _request(session_id: bytes | None, body: dict, *, chunked: bool) -> bytes:
    data = json.dumps(body).encode()
    head = b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    if session_id is not None:
        head += b"X-Session-ID: " + session_id + b"\r\n"
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(data), data)


async def _send(router, session_id: bytes | None, body: dict | None = None, *, chunked: bool):
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        status, _, data = await exchange(reader, writer, _request(session_id, body or {}, chunked=chunked))
    finally:
        writer.close()
    return status, json.loads(data)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_long_session_id_is_refused_before_anything_is_pinned(router, upstream, chunked):
    status, error = await _send(router, b"s" * (MAX_SESSION_ID_BYTES + 1), chunked=chunked)
    assert status == 400, error
    assert error["error"]["param"] == "X-Session-ID"
    assert str(MAX_SESSION_ID_BYTES) in error["error"]["message"]
    assert router._sessions == {} and upstream[1] == []
    # The probe: many ~64 KB ids leave the table empty.
    for index in range(20):
        status, error = await _send(router, b"%d-" % index + b"x" * 60_000, chunked=chunked)
        assert status == 400
        if not chunked:  # aiohttp refuses a header line over 8 KB itself, before the router reads it
            assert error["error"]["param"] == "X-Session-ID"
    assert router._sessions == {} and upstream[1] == []
    # At the limit it is a session.
    status, _ = await _send(router, b"s" * MAX_SESSION_ID_BYTES, chunked=chunked)
    assert status == 200 and len(router._sessions) == 1


async def test_long_body_session_id_is_refused(router, upstream):
    body = {"session_id": "b" * (MAX_SESSION_ID_BYTES + 1)}
    status, error = await _send(router, None, body, chunked=False)
    assert status == 400 and error["error"]["param"] == "session_id", error
    assert router._sessions == {} and upstream[1] == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_refused_request_pins_no_session(router, upstream, chunked):
    status, _ = await _send(router, b"refused-1", {"refuse": True}, chunked=chunked)
    assert status == 400 and len(upstream[1]) == 1
    assert router._sessions == {}
    status, _ = await _send(router, b"accepted-1", chunked=chunked)
    assert status == 200 and list(router._sessions) == ["accepted-1"]
    # A refused turn of a session that already holds a server keeps it.
    status, _ = await _send(router, b"accepted-1", {"refuse": True}, chunked=chunked)
    assert status == 400 and list(router._sessions) == ["accepted-1"]


async def test_non_ascii_session_id_is_one_session_on_both_paths(router, upstream):
    raw = "sess-é-会话".encode()
    for chunked in (False, True):
        status, _ = await _send(router, raw, chunked=chunked)
        assert status == 200
    # Named in the body as text, it is the same session too.
    status, _ = await _send(router, None, {"session_id": "sess-é-会话"}, chunked=False)
    assert status == 200
    assert list(router._sessions) == ["sess-é-会话"]
    assert router.finish_session("sess-é-会话")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_session_id_that_is_not_utf8_is_refused(router, upstream, chunked):
    status, error = await _send(router, b"sess-\xff\xfe", chunked=chunked)
    assert status == 400, error
    assert error["error"]["param"] == "X-Session-ID" and "UTF-8" in error["error"]["message"]
    assert router._sessions == {} and upstream[1] == []


async def test_finish_session_reads_the_header_as_the_proxy_does(router, upstream):
    raw = "sess-é".encode()
    status, _ = await _send(router, raw, chunked=False)
    assert status == 200 and list(router._sessions) == ["sess-é"]
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = b"POST /finish_session HTTP/1.1\r\nHost: router\r\nContent-Length: 0\r\nX-Session-ID: "
        status, _, data = await exchange(reader, writer, head + raw + b"\r\n\r\n")
    finally:
        writer.close()
    assert status == 200 and json.loads(data)["found"] is True
    assert router._sessions == {}


@pytest.fixture
async def engine_server(tiny_chat, uncached_engine):
    from rollflow.inference.engine.server import EngineServer

    server = EngineServer(
        uncached_engine, tiny_chat.tokenizer, served_model_name="tiny", renderer=tiny_chat.renderer
    )
    url = await server.start()
    try:
        yield url
    finally:
        # Not server.close(): the module's engine outlives the test.
        await server._runner.cleanup()


async def test_the_server_bounds_and_decodes_session_ids_as_the_router_does(engine_server):
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}}
    async with aiohttp.ClientSession() as http:
        long_id = {"X-Session-ID": "s" * (MAX_SESSION_ID_BYTES + 1)}
        async with http.post(f"{engine_server}{PATH}", json=body, headers=long_id) as response:
            error = await response.json()
            assert response.status == 400 and error["error"]["param"] == "X-Session-ID", error
        async with http.post(f"{engine_server}{PATH}", json={**body, "session_id": "b" * 300}) as response:
            error = await response.json()
            assert response.status == 400 and error["error"]["param"] == "session_id", error
        async with http.post(
            f"{engine_server}{PATH}", json=body, headers={"X-Session-ID": "ok-1"}
        ) as response:
            assert response.status == 200, await response.text()
