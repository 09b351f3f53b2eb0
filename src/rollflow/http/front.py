"""``HttpFront``: a small HTTP/1.1 server for a listener's hot requests, aiohttp's server for the rest.

aiohttp's server builds a request object, header multidicts, a payload stream, middlewares' coroutines, a
response object and its writer for every request: profiled under load that is more than half of the CPU per
request of the router (``benchmarks/router_compare.py``) and a third of the TITO proxy's HTTP handling
(``benchmarks/tito_load.py``). ``HttpFront`` is the protocol of every accepted connection of such a listener.
It reads each request's head itself; a plain request (``POST`` over HTTP/1.1 with a ``Host``, a
``Content-Length`` body within ``max_body_bytes``, no ``Expect`` nor ``Transfer-Encoding``, nothing malformed)
to a path its ``FrontHost`` ``accepts`` is read whole, and the host's ``fast_request`` then either returns the
coroutine that answers it (written straight to the connection) or declines. The first request that is anything
else hands the whole connection, with the bytes read so far, to aiohttp's handler, which then serves it as
before (admin and control endpoints, 401, 404, 413, chunked uploads, streamed answers …).

The front keeps the listener's limits (``HttpLimits``): a request line and headers not complete within
``header_timeout_s`` of the connection opening get 408 (an idle kept-alive connection is closed silently after
as long), a body not complete within ``body_timeout_s`` gets 408, and a connection over ``max_connections`` gets
503. A caller that disconnects cancels its request's coroutine (so the work behind it is cancelled too).
Requests are answered in order, one at a time per connection (pipelined ones wait in the buffer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import structlog

from rollflow.http.errors import raw_error_response
from rollflow.http.limits import HttpLimits

log = structlog.get_logger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
# Buffered bytes beyond this (a pipelining caller while a request is in flight) pause reading.
_HIGH_WATER = 1 << 20

# One header line as the front read it: (lower-case name, name as sent, value stripped of surrounding space).
Header = tuple[bytes, bytes, bytes]


class FrontHost(Protocol):
    """The listener behind ``HttpFront``: its limits, its connection count, and its hot requests."""

    http_limits: HttpLimits
    max_body_bytes: int
    fronts: set[HttpFront]  # connections the front serves now; the host closes them when it stops

    def open_connections(self) -> int:
        """Connections open to the listener: the fronts' and those handed to aiohttp."""
        ...

    def accepts(self, path: str) -> bool:
        """Whether a ``POST`` to ``path`` (with its query) may be a hot request: its body is then read by the
        front. Decided on the path alone, so that other bodies (uploads) stream into aiohttp unbuffered."""
        ...

    def fast_request(
        self, front: HttpFront, path: str, headers: list[Header], body: bytes
    ) -> Coroutine[Any, Any, None] | None:
        """The coroutine that answers this request on ``front`` (``front.write``), or None: aiohttp serves it
        (and every later request on the connection). Called on the event loop; keep it cheap."""
        ...


class HttpFront(asyncio.Protocol):
    """One accepted connection of ``host`` (see the module docstring); ``handoff`` makes aiohttp's handler."""

    __slots__ = (
        "_buffer",
        "_busy",
        "_deadline",
        "_deadline_phase",
        "_drain",
        "_handoff",
        "_host",
        "_paused_reading",
        "_paused_writing",
        "_served",
        "_task",
        "close_after",
        "closed",
        "transport",
    )

    def __init__(self, host: FrontHost, handoff: Callable[[], asyncio.Protocol]):
        self._host = host
        self._handoff = handoff
        self._buffer = bytearray()
        self._busy = False
        self._served = 0
        self._task: asyncio.Task[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_phase: str | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused_reading = False
        self._paused_writing = False
        self.close_after = False  # the request being served asked for ``Connection: close``
        self.closed = False
        self.transport: asyncio.Transport | None = None

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        host = self._host
        host.fronts.add(self)
        limits = host.http_limits
        if host.open_connections() > limits.max_connections:
            self._fail(
                503,
                f"the server has {limits.max_connections} connections open (its limit, max_connections); "
                "retry later",
            )
            return
        self._arm(limits.header_timeout_s, "header")

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._busy:
            if len(self._buffer) > _HIGH_WATER and not self._paused_reading and self.transport is not None:
                self._paused_reading = True
                self.transport.pause_reading()
            return
        self._next()

    def eof_received(self) -> bool | None:
        return False  # a half-closed connection is closed, as aiohttp's handler does

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._disarm()
        self._host.fronts.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the caller left: so does the work for its request
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark (or the caller left)."""
        while self._paused_writing and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain
        if self.closed:
            raise ConnectionResetError("the caller closed the connection")

    def write(self, data: bytes | bytearray) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    # ------------------------------------------------------------------ requests

    def _next(self) -> None:
        """Serve the next complete request in the buffer, or hand the connection over, or wait for more."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEAD_BYTES:
                self._hand_off()  # aiohttp answers the oversized head as it always did
            elif buffer and self._deadline is None:
                self._arm(self._host.http_limits.header_timeout_s, "header")
            return
        request = self._parse_head(bytes(buffer[:end]))
        if request is None:
            self._hand_off()
            return
        path, headers, length, close = request
        if len(buffer) < end + 4 + length:
            if self._deadline_phase != "body":
                self._arm(self._host.http_limits.body_timeout_s, "body")
            return
        self._disarm()
        body = bytes(buffer[end + 4 : end + 4 + length])
        answer = self._host.fast_request(self, path, headers, body)
        if answer is None:
            self._hand_off()  # the request is still in the buffer: aiohttp reads it from the start
            return
        del buffer[: end + 4 + length]
        self._busy = True
        self.close_after = close
        self._task = asyncio.get_running_loop().create_task(self._serve(answer, path))

    def _parse_head(self, head: bytes) -> tuple[str, list[Header], int, bool] | None:
        """(path, headers, body length, close) if the request may be hot, else None (aiohttp serves it)."""
        if b"\n" in head.replace(b"\r\n", b"") or b"\r" in head.replace(b"\r\n", b""):
            return None  # bare CR or LF: aiohttp's parser decides (never serve what it would split)
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
            return None
        host = self._host
        path = parts[1].decode("latin-1")
        if not host.accepts(path):
            return None
        headers: list[Header] = []
        length: int | None = None
        close = False
        has_host = False
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                return None  # malformed or folded: aiohttp's parser decides
            value = value.strip()
            lower = name.lower()
            if lower == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif lower == b"connection":
                close = b"close" in value.lower()
            elif lower == b"host":
                has_host = True
            elif lower in (b"transfer-encoding", b"expect"):
                return None
            headers.append((lower, name, value))
        if not has_host or length is None or length > host.max_body_bytes:
            return None
        return path, headers, length, close

    async def _serve(self, answer: Coroutine[Any, Any, None], path: str) -> None:
        try:
            await answer
        except Exception as error:  # a broken answer mid-stream: the connection cannot carry another
            log.debug("answer broken", path=path, error=repr(error))
            self._close()
            return
        finally:
            self._task = None
            self._busy = False
        if self.close_after:
            self._close()
            return
        self._served += 1
        if self._paused_reading and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()
        if self._buffer:
            self._next()
        elif not self.closed:
            # An idle kept-alive connection is held no longer than a request head may take, then closed.
            self._arm(self._host.http_limits.header_timeout_s, "idle")

    # ------------------------------------------------------------------ hand-off, limits

    def _hand_off(self) -> None:
        """From now on aiohttp's handler serves this connection, starting with the bytes buffered here."""
        self._disarm()
        self._host.fronts.discard(self)
        transport = self.transport
        if transport is None or self.closed:
            return
        handler = self._handoff()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        data, self._buffer = bytes(self._buffer), bytearray()
        self.transport = None
        if data:
            handler.data_received(data)

    def _arm(self, timeout_s: float, phase: str) -> None:
        self._disarm()
        self._deadline_phase = phase
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._timed_out, phase, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_phase = None

    def _timed_out(self, phase: str, timeout_s: float) -> None:
        self._deadline = None
        self._deadline_phase = None
        if self._busy or self.closed:
            return
        if phase == "idle" and not self._buffer:
            self._close()
        elif phase == "body":
            self._fail(408, f"the request body did not arrive within body_timeout_s = {timeout_s:g} s")
        else:
            self._fail(
                408, f"the request line and headers did not arrive within header_timeout_s = {timeout_s:g} s"
            )

    def _fail(self, status: int, message: str) -> None:
        self.write(raw_error_response(status, message))
        self._close()

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()


def count_connections(fronts: set[HttpFront], runner: Any) -> int:
    """Connections open to a listener: those its fronts serve and those handed to ``runner``'s aiohttp server."""
    server = runner.server if runner is not None else None
    return len(fronts) + (len(server.connections) if server is not None else 0)


def stop_listening(server: asyncio.Server | None, fronts: set[HttpFront]) -> None:
    """Stop accepting and close the connections the fronts still serve (those handed to aiohttp close with its
    runner's cleanup)."""
    if server is not None:
        server.close()
    for front in list(fronts):
        if front.transport is not None:
            front.transport.close()
    fronts.clear()


async def serve_with_front(
    host: FrontHost, handoff: Callable[[], Any], address: str, port: int
) -> asyncio.Server:
    """Listen on ``address``:``port``: every connection starts with an ``HttpFront`` of ``host``, which hands
    it to ``handoff()`` (aiohttp's ``web.Server``) at its first request the front does not serve."""
    return await asyncio.get_running_loop().create_server(
        lambda: HttpFront(host, handoff), address, port, backlog=128
    )
