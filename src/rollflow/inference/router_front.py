"""The router's listener: a small HTTP/1.1 server for the hot data-plane requests, aiohttp for the rest.

aiohttp's server builds a request object, header multidicts, a payload stream, middlewares' coroutines, a
response object and its writer for every request: profiled under ``benchmarks/router_compare.py`` load that is
more than half of the router's CPU per proxied request. ``RouterFront`` is the protocol of every accepted
connection. It reads each request's head itself; a request that the hot path serves exactly as aiohttp would
(``POST`` of a proxied path over HTTP/1.1, naming its session in ``X-Session-ID``, with a ``Content-Length``
body within ``max_body_bytes``, no ``Expect``, and the bearer token when an API key is set) is proxied straight
from and to the socket (``InferenceRouter.proxy_fast``). The first request that is anything else hands the whole
connection, with the bytes read so far, to aiohttp's handler, which then serves it as before (admin and control
endpoints, 401, 404, 413, sessions named in the body, chunked uploads …).

The front keeps the listener's limits (``HttpLimits``): a request line and headers not complete within
``header_timeout_s`` of the connection opening get 408 (an idle kept-alive connection is closed silently after
as long), a body not complete within ``body_timeout_s`` gets 408, and a connection over ``max_connections`` gets
503. A caller that disconnects cancels its request, so the server sees the disconnect too. Requests are
answered in order, one at a time per connection (pipelined ones wait in the buffer).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.inference.http import raw_error_response

if TYPE_CHECKING:
    from rollflow.inference.router import InferenceRouter

log = structlog.get_logger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
# Buffered bytes beyond this (a pipelining caller while a request is in flight) pause reading.
_HIGH_WATER = 1 << 20


class RouterFront(asyncio.Protocol):
    """One accepted connection of ``router`` (see the module docstring); ``handoff`` makes aiohttp's handler."""

    __slots__ = (
        "_buffer",
        "_busy",
        "_deadline",
        "_deadline_phase",
        "_drain",
        "_handoff",
        "_paused_reading",
        "_paused_writing",
        "_router",
        "_served",
        "_task",
        "closed",
        "transport",
    )

    def __init__(self, router: InferenceRouter, handoff: Callable[[], asyncio.Protocol]):
        self._router = router
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
        self.closed = False
        self.transport: asyncio.Transport | None = None

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        router = self._router
        router._fronts.add(self)
        limits = router.http_limits
        if router.open_connections() > limits.max_connections:
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
        self._router._fronts.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the caller left: so does its upstream request
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
                self._arm(self._router.http_limits.header_timeout_s, "header")
            return
        request = self._parse_head(bytes(buffer[:end]))
        if request is None:
            self._hand_off()
            return
        method, path, headers, session_id, length, close = request
        if len(buffer) < end + 4 + length:
            if self._deadline_phase != "body":
                self._arm(self._router.http_limits.body_timeout_s, "body")
            return
        self._disarm()
        body = bytes(buffer[end + 4 : end + 4 + length])
        del buffer[: end + 4 + length]
        self._busy = True
        self._task = asyncio.get_running_loop().create_task(
            self._serve(method, path, headers, session_id, body, close)
        )

    def _parse_head(self, head: bytes) -> tuple[str, str, list[tuple[bytes, bytes]], str, int, bool] | None:
        """The request if the hot path serves it, else None (aiohttp will)."""
        if b"\n" in head.replace(b"\r\n", b"") or b"\r" in head.replace(b"\r\n", b""):
            return None  # bare CR or LF: aiohttp's parser decides (never forward what it would split)
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
            return None
        router = self._router
        path = parts[1].decode("latin-1")
        if path.partition("?")[0] not in router.fast_paths:
            return None
        hop = router.hop_header_bytes
        headers: list[tuple[bytes, bytes]] = []
        session_id: str | None = None
        length: int | None = None
        authorization: bytes | None = None
        close = False
        host = False
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
            elif lower == b"x-session-id":
                if session_id is not None:
                    return None  # named twice: aiohttp's path reads the first, as it always did
                session_id = value.decode("latin-1")
            elif lower == b"authorization":
                authorization = value
            elif lower == b"connection":
                close = b"close" in value.lower()
            elif lower == b"host":
                host = True
            elif lower in (b"transfer-encoding", b"expect"):
                return None
            if lower not in hop:
                headers.append((name, value))
        if not host or not session_id or length is None or length > router.max_body_bytes:
            return None
        if router.api_key:
            scheme, _, token = authorization.partition(b" ") if authorization else (b"", b"", b"")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, router.api_key.encode()):
                return None  # aiohttp's middleware answers 401
        return "POST", path, headers, session_id, length, close

    async def _serve(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        session_id: str,
        body: bytes,
        close: bool,
    ) -> None:
        try:
            await self._router.proxy_fast(self, method, path, session_id, headers, body)
        except Exception as error:  # a broken answer mid-stream: the connection cannot carry another
            log.debug("proxied answer broken", path=path, error=repr(error))
            self._close()
            return
        finally:
            self._task = None
            self._busy = False
        if close:
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
            self._arm(self._router.http_limits.header_timeout_s, "idle")

    # ------------------------------------------------------------------ hand-off, limits

    def _hand_off(self) -> None:
        """From now on aiohttp's handler serves this connection, starting with the bytes buffered here."""
        self._disarm()
        self._router._fronts.discard(self)
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


def make_front_factory(router: InferenceRouter, handoff: Callable[[], Any]) -> Callable[[], RouterFront]:
    """The protocol factory for ``loop.create_server``."""
    return lambda: RouterFront(router, handoff)
