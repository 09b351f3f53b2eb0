"""The router's data-plane client: kept-alive HTTP/1.1 connections to one server, with little per-request work.

aiohttp's client builds a request object, a response object, header multidicts, a payload wrapper, timers and
trace hooks for every call: about a third of the router's CPU per proxied request. The router needs much less:
it forwards bytes it already has. ``UpstreamPool`` writes the request line, the caller's headers (as raw bytes,
less the hop-by-hop ones) and the body in one write, and reads the answer with a small parser: a status line,
headers, then a body by ``Content-Length``, by chunked transfer coding (streams), or until the server closes.

Connections are reused after a complete answer that does not ask to close. A request that fails on a reused
connection before any byte of the answer arrived (the server closed it while idle) is sent once more on a new
connection to the same server, so a session keeps its server. Anything else surfaces as ``UpstreamError``:
``connect=True`` when no connection could be opened (the server is down), else the connection broke.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

# Seconds an idle pooled connection of rollflow's aiohttp clients (the remote inference client, the router's
# probes and control fan-out) is kept: below the keep-alive of the servers behind them (vLLM's uvicorn closes an
# idle connection after 5 s), so a request never goes out on a connection the server is closing. With
# aiohttp's 15 s, a control call after 5-15 s of quiet could meet "Server disconnected" without the server
# having seen it (a fully async run on vLLM failed so at a weight update).
CLIENT_KEEPALIVE_S = 4.0

# Response bodies buffered beyond this stop the socket's reading until the caller takes them (flow control).
_HIGH_WATER = 1 << 20
_MAX_HEAD_BYTES = 64 * 1024


class UpstreamError(Exception):
    """A request to a server failed on the connection; ``connect``: no connection could be opened at all."""

    def __init__(self, message: str, *, connect: bool = False):
        super().__init__(message)
        self.connect = connect


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: the bytes received so far, and a waiter for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: BaseException | None = None
        self.aborted: str | None = None  # why this side closed it mid-request (``UpstreamPool.abort``)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for more bytes; raises ``UpstreamError`` when the server closed the connection."""
        if self.aborted is not None:
            raise UpstreamError(f"the request was given up: {self.aborted}")
        if self.closed:
            raise UpstreamError(f"the server closed the connection{f': {self.error}' if self.error else ''}")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self, count: int) -> bytes:
        data = bytes(self.buffer[:count])
        del self.buffer[:count]
        if self._paused and len(self.buffer) < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_until(self, separator: bytes, limit: int) -> bytes:
        while (end := self.buffer.find(separator)) < 0:
            if len(self.buffer) > limit:
                raise UpstreamError(f"the server sent more than {limit} bytes without {separator!r}")
            await self._more()
        return self._take(end + len(separator))

    async def read_exactly(self, count: int) -> bytes:
        while len(self.buffer) < count:
            await self._more()
        return self._take(count)

    async def read_some(self) -> bytes:
        """What is buffered, waiting for something first; b"" once the server closed."""
        while not self.buffer:
            if self.closed and self.aborted is None:
                return b""
            await self._more()
        return self._take(len(self.buffer))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A server's answer: ``status``, ``headers`` (name, value) as sent, and the body, read once."""

    __slots__ = ("_connection", "_pool", "_reusable", "chunked", "content_length", "headers", "status")

    def __init__(
        self, pool: UpstreamPool, connection: _Connection, status: int, headers: list[tuple[str, str]]
    ):
        self._pool = pool
        self._connection = connection
        self.status = status
        self.headers = headers
        self.content_length: int | None = None
        self.chunked = False
        keep_alive = True
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length":
                try:
                    self.content_length = int(value)
                except ValueError:
                    raise UpstreamError(f"the server sent an invalid Content-Length: {value!r}") from None
            elif lower == "transfer-encoding":
                self.chunked = "chunked" in value.lower()
            elif lower == "connection":
                keep_alive = "close" not in value.lower()
        if self.chunked:
            self.content_length = None
        if status in (204, 304) or 100 <= status < 200:
            self.content_length = 0
        # Without a length or chunks, the body runs until the server closes: the connection ends with it.
        self._reusable = keep_alive and (self.chunked or self.content_length is not None)

    def content_type(self) -> str:
        return next((value for name, value in self.headers if name.lower() == "content-type"), "")

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. The connection goes back to the pool once it has all been read; a reader that
        stops early (or fails) leaves the connection closed."""
        connection = self._connection
        done = False
        try:
            if self.content_length is not None:
                remaining = self.content_length
                while remaining:
                    if not connection.buffer:
                        await connection._more()
                    chunk = connection._take(min(remaining, len(connection.buffer)))
                    remaining -= len(chunk)
                    yield chunk
            elif self.chunked:
                while True:
                    line = await connection.read_until(b"\r\n", _MAX_HEAD_BYTES)
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise UpstreamError(
                            f"the server sent an invalid chunk size line: {line[:80]!r}"
                        ) from None
                    if size == 0:
                        # Trailers (if any) end with an empty line.
                        while await connection.read_until(b"\r\n", _MAX_HEAD_BYTES) != b"\r\n":
                            pass
                        break
                    yield await connection.read_exactly(size)
                    await connection.read_exactly(2)  # the CRLF after the chunk
            else:
                while chunk := await connection.read_some():
                    yield chunk
            done = True
        finally:
            self._pool._release(connection, reusable=done and self._reusable)

    def release(self) -> None:
        """Give up the body unread: the connection is closed."""
        self._pool._release(self._connection, reusable=False)


class UpstreamPool:
    """Kept-alive connections to the server at ``url`` (``http(s)://host:port``).

    Args:
        url: the server's base URL.
        connect_timeout_s: longest opening a connection may take.
        max_idle: idle connections kept at most (more are closed after their answer).
        ssl_context: for ``https`` URLs; the default verifies the server's certificate.
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        max_idle: int = 1024,
        ssl_context: ssl_module.SSLContext | None = None,
    ):
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl_module.create_default_context()) if parts.scheme == "https" else None
        default_port = 443 if parts.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = (host if self.port == default_port else f"{host}:{self.port}").encode()
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()  # connections with a request on them (``abort`` closes them)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as error:
            raise UpstreamError(
                f"could not connect to {self.host}:{self.port}: {error!r}", connect=True
            ) from None
        return connection

    def _release(self, connection: _Connection, *, reusable: bool) -> None:
        self._busy.discard(connection)
        if reusable and not connection.closed and not connection.buffer and len(self._idle) < self.max_idle:
            self._idle.append(connection)
        else:
            connection.close()

    async def request(
        self,
        method: str,
        path_qs: str,
        raw_headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        extra_headers: bytes = b"",
    ) -> UpstreamResponse:
        """Send one request and read the answer's status and headers; the body is the caller's to read
        (``UpstreamResponse.read``/``iter_chunks``) or give up (``release``).

        ``raw_headers`` are sent as given (hop-by-hop ones already left out), then ``extra_headers`` (complete
        lines); ``Host`` and ``Content-Length`` are set here.

        Raises:
            UpstreamError: no connection, or it broke before the answer's headers were complete.
        """
        head = bytearray(f"{method} {path_qs} HTTP/1.1\r\nHost: ".encode())
        head += self._host_header
        head += b"\r\nContent-Length: %d\r\n" % len(body)
        for name, value in raw_headers:
            head += name + b": " + value + b"\r\n"
        head += extra_headers
        head += b"\r\n"
        head += body
        while self._idle:
            connection = self._idle.pop()
            if connection.closed:
                continue
            try:
                return await self._exchange(connection, head)
            except UpstreamError:
                # Closed by the server while idle, maybe just now: a fresh connection decides.
                connection.close()
                break
        return await self._exchange(await self._connect(), head)

    async def _exchange(self, connection: _Connection, head: bytearray) -> UpstreamResponse:
        self._busy.add(connection)
        try:
            assert connection.transport is not None
            connection.transport.write(head)
            while True:
                lines = (await connection.read_until(b"\r\n\r\n", _MAX_HEAD_BYTES))[:-4].split(b"\r\n")
                parts = lines[0].split(b" ", 2)
                if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                    raise UpstreamError(f"the server sent an invalid status line: {lines[0][:80]!r}")
                status = int(parts[1])
                if status != 100:  # 100 Continue is an interim answer; the real one follows
                    break
            headers = []
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers.append((name.decode("latin-1").strip(), value.decode("latin-1").strip()))
            return UpstreamResponse(self, connection, status, headers)
        except BaseException:
            self._busy.discard(connection)
            connection.close()
            raise

    def abort(self, reason: str) -> int:
        """Close every connection, those with a request in flight too: their readers raise
        ``UpstreamError`` naming ``reason`` (before the answer's head, a caller may retry elsewhere). For a
        server taken out of rotation, whose answers would never come. Returns how many were in flight."""
        busy = list(self._busy)
        for connection in busy:
            connection.aborted = reason
            connection.close()
            connection._wake()
        self._busy.clear()
        self.close()
        return len(busy)

    def close(self) -> None:
        """Close the idle connections (those in use close when their answers are done)."""
        for connection in self._idle:
            connection.close()
        self._idle.clear()
