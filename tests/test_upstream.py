"""``UpstreamPool``, the router's data-plane client, against small real servers on loopback: bodies by length,
by chunks and until close, reuse of kept-alive connections, a connection the server closed while idle, errors."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from rollflow.http.upstream import UpstreamError, UpstreamPool
from rollflow.launch.server_group import free_port

from .helpers.waits import wait_until


@contextlib.asynccontextmanager
async def raw_server(answer):
    """A TCP server whose every connection is handled by ``answer(reader, writer)``; yields (url, connections)."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return head + await reader.readexactly(length)


async def test_lengths_chunks_and_reuse():
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/stream":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for index in range(3):
                await response.write(f"data: {index}\n\n".encode())
            await response.write_eof()
            return response
        return web.Response(body=body[::-1], headers={"X-Seen": request.headers.get("X-Session-ID", "")})

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    pool = UpstreamPool(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        for index in range(3):
            response = await pool.request("POST", "/echo?x=1", [(b"X-Session-ID", b"s%d" % index)], b"abc")
            assert response.status == 200 and response.content_length == 3
            assert ("X-Seen", f"s{index}") in response.headers
            assert await response.read() == b"cba"
            assert len(pool._idle) == 1  # the one connection, back for the next request
        response = await pool.request("POST", "/stream", [], b"")
        assert response.chunked and response.content_length is None
        chunks = [chunk async for chunk in response.iter_chunks()]
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert len(pool._idle) == 1
    finally:
        pool.close()
        await runner.cleanup()


async def test_a_connection_closed_while_idle_is_replaced_and_bodies_until_close():
    async def keep_alive_then_close(reader, writer):
        # Answers one request as if the connection stayed open, then closes it (an idle timeout).
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(keep_alive_then_close) as (url, connections):
        pool = UpstreamPool(url)
        assert await (await pool.request("GET", "/", [], b"")).read() == b"ok"
        await wait_until(lambda: pool._idle[0].closed, "the pool sees the server close its idle connection")
        assert await (await pool.request("GET", "/", [], b"")).read() == b"ok"
        assert len(connections) == 2
        pool.close()

    async def until_close(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()

    async with raw_server(until_close) as (url, _):
        pool = UpstreamPool(url)
        response = await pool.request("GET", "/", [], b"")
        assert response.content_length is None and not response.chunked
        assert await response.read() == b"part one, part two"
        assert pool._idle == []  # a body that ends with the connection leaves nothing to reuse
        pool.close()


async def test_interim_100_continue_is_skipped():
    async def with_continue(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async with raw_server(with_continue) as (url, _):
        pool = UpstreamPool(url)
        response = await pool.request("POST", "/", [], b"x")
        assert response.status == 201 and await response.read() == b""
        pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"SMTP ready\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",  # a bad length
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk size
    ],
)
async def test_broken_answers_are_upstream_errors(answer):
    async def broken(reader, writer):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_server(broken) as (url, _):
        pool = UpstreamPool(url)
        with pytest.raises(UpstreamError) as error:
            await (await pool.request("GET", "/", [], b"")).read()
        assert not error.value.connect and pool._idle == []
        pool.close()


async def test_no_server_is_a_connect_error():
    pool = UpstreamPool(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2)
    with pytest.raises(UpstreamError, match="could not connect") as error:
        await pool.request("GET", "/", [], b"")
    assert error.value.connect
