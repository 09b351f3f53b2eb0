"""The app runner of rollflow's aiohttp listeners (``rollflow serve``, the router, the TITO proxy): vLLM-style
JSON errors everywhere, and limits that keep slow or idle clients from holding a server.

aiohttp answers requests it cannot parse (a bad ``Content-Length``, a malformed request line) from its protocol
layer with a plain-text body before any handler runs; ``JSONErrorAppRunner`` makes those JSON too, so every
error a client can cause is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.

aiohttp itself puts no deadline on a request's line, headers or body (its keep-alive timer, an hour by
default, is the only one), so a few hundred connections that stall mid-request would hold the server's file
descriptors for good. ``JSONErrorAppRunner`` also enforces ``HttpLimits`` per connection, with one timer
each (no polling):

- request line and headers must be complete within ``header_timeout_s`` of the connection opening or, on
  a kept-alive connection, of the previous response (then aiohttp's keep-alive timer, set to the same
  value, closes it without a reply: the client may be sending its next request at that very moment);
- the body must be complete within ``body_timeout_s`` of the end of the headers;
- a connection past either deadline gets a 408 JSON error (when no response has started) and is closed;
  its handler is cancelled, which aborts its engine request;
- beyond ``max_connections`` open connections a new connection's request gets a 503 JSON error and the
  connection is closed.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from rollflow.http.errors import json_error, raw_error_response
from rollflow.http.limits import HttpLimits

log = structlog.get_logger(__name__)


def raise_open_file_limit() -> int | None:
    """Raise this process's soft limit on open files to its hard limit (as vLLM does: every connection is a
    file descriptor) and return the limit now in force (None where there is no such limit: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class _JSONErrorRequestHandler(RequestHandler):
    def __init__(self, manager: Any, *, limits: HttpLimits, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        # Payload of the request whose body is still arriving (its deadline is armed).
        self._body_payload: Any = None

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response already started: the connection is broken
            raise ConnectionError("response already started; cannot send the error response")
        log.debug("unparseable request", status=status, error=repr(exc))
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error"
        detail = getattr(exc, "message", None) or message or phrase
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        json_response = json_error(status, f"{phrase}: {detail}")
        json_response.force_close()
        return json_response

    # ------------------------------------------------------------------ slow clients and connection cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._keepalive_handle is not None:
            # Our header deadline answers a new connection with a 408; aiohttp's keep-alive timer (closing
            # silently) only guards the idle time after a response.
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        manager = self._manager
        if manager is not None and len(manager._connections) > self._limits.max_connections:
            # Answer this connection's request with 503 instead of the application, then close.
            self._request_handler = self._over_capacity
        self._arm(self._limits.header_timeout_s, "header")

    async def _over_capacity(self, request: web.BaseRequest) -> web.StreamResponse:
        limit = self._limits.max_connections
        response = json_error(
            503, f"the server has {limit} connections open (its limit, max_connections); retry later"
        )
        response.force_close()
        return response

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a request's headers are complete
            self._disarm()
            payload = self._messages[-1][1] if self._messages else None
            if payload is not None and not payload.is_eof():
                self._body_payload = payload
                self._arm(self._limits.body_timeout_s, "body")
        elif self._body_payload is not None:
            if self._body_payload.is_eof():
                self._body_payload = None
                self._disarm()
        elif self._deadline is None and data and not self._force_close:
            self._arm(self._limits.header_timeout_s, "header")  # the next request on a kept-alive connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._body_payload = None
        super().connection_lost(exc)

    def _arm(self, timeout_s: float, phase: str) -> None:
        self._disarm()
        self._deadline = self._loop.call_later(timeout_s, self._timed_out, phase, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self, phase: str, timeout_s: float) -> None:
        self._deadline = None
        transport = self.transport
        if transport is None or self._force_close:
            return
        request = self._current_request
        if phase == "header":
            if self._request_in_progress:
                # A pipelined request arrives while the one before is still being answered: its deadline
                # starts over rather than cutting the request in progress short.
                self._arm(timeout_s, phase)
                return
            answer = True
            what, key = "request line and headers", "header_timeout_s"
        else:
            answer = request is not None and request.writer.output_size == 0
            what, key = "request body", "body_timeout_s"
        log.debug("closing a slow connection", phase=phase, peer=self.peername)
        if answer:
            transport.write(
                raw_error_response(408, f"the {what} did not arrive within {key} = {timeout_s:g} s")
            )
        self._body_payload = None
        self.force_close()


class _JSONErrorServer(web.Server):
    http_limits: HttpLimits

    def __call__(self) -> RequestHandler:
        return _JSONErrorRequestHandler(self, loop=self._loop, limits=self.http_limits, **self._kwargs)


class JSONErrorAppRunner(web.AppRunner):
    """An ``AppRunner`` whose protocol-level errors (unparseable requests) are JSON, like handler errors, and
    whose connections are held to ``limits`` (``HttpLimits()`` by default)."""

    def __init__(self, app: web.Application, *, limits: HttpLimits | None = None, **kwargs: Any):
        limits = limits or HttpLimits()
        # aiohttp's keep-alive timer closes a connection that has no complete request this long after it
        # opened or after its last response: idle kept-alive connections are held no longer than a header.
        kwargs.setdefault("keepalive_timeout", limits.header_timeout_s)
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer
        server.http_limits = self.limits
        return server
