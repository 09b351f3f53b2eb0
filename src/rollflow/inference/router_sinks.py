"""Where the router writes a proxied answer: a ``ResponseSink`` per caller, so that one forward path
(``InferenceRouter._forward``: retries, failover, engine-dead detection, progress, timeouts) serves both the
requests aiohttp read (``AiohttpSink``, an aiohttp response the handler returns) and those the router's own
front read (``FrontSink``, raw HTTP/1.1 bytes written to the caller's connection).

A sink gets the upstream's status and headers as they came (it drops the hop-by-hop ones and adds the
``X-Rollflow-Worker`` header in its own wire form), then either a whole body (``answer``) or a stream
(``start``, ``write`` per chunk, ``end``), or an error the router makes itself (``error``).
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from aiohttp import web

from rollflow.errors import error_body
from rollflow.http.errors import json_error, raw_json_response, reason_phrase
from rollflow.http.front import HttpFront

# Response header naming the server that answered (for debugging and affinity checks).
WORKER_HEADER = "X-Rollflow-Worker"
# Not forwarded either way (RFC 9110 §7.6.1), plus what aiohttp or the front recomputes.
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        "Date",
        "Server",
    )
)
_WORKER_HEADER_PREFIX = f"{WORKER_HEADER}: ".encode()


class ResponseSink(Protocol):
    """One caller's side of a proxied request. ``answer`` and ``error`` complete it; after ``start`` only
    ``write`` and ``end`` may follow."""

    def answer(self, status: int, headers: list[tuple[str, str]], worker_url: str, body: bytes) -> None:
        """The whole answer of ``worker_url``: its status, its headers (hop-by-hop ones included) and body."""
        ...

    async def start(self, status: int, headers: list[tuple[str, str]], worker_url: str) -> None:
        """Send the head of a streamed answer; its body follows in ``write`` calls."""
        ...

    async def write(self, chunk: bytes) -> None:
        """One chunk of a streamed answer, waiting while the caller reads slower than the server writes."""
        ...

    async def end(self) -> None:
        """End a streamed answer."""
        ...

    def error(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        """Answer with the router's own JSON error."""
        ...


def error_bytes(
    status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | None = None
) -> bytes:
    """A kept-alive HTTP/1.1 response carrying the JSON error (as ``json_error`` shapes it)."""
    body = msgspec.json.encode(error_body(status, message, type=type, param=param, code=code))
    return raw_json_response(status, body, content_type=b"application/json; charset=utf-8")


class AiohttpSink:
    """A sink for a request aiohttp read: ``response`` is what its handler returns."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request):
        self._request = request
        self.response: web.StreamResponse | None = None

    @staticmethod
    def _headers(headers: list[tuple[str, str]], worker_url: str) -> list[tuple[str, str]]:
        out = [(name, value) for name, value in headers if name.lower() not in HOP_HEADERS]
        out.append((WORKER_HEADER, worker_url))
        return out

    def answer(self, status: int, headers: list[tuple[str, str]], worker_url: str, body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=self._headers(headers, worker_url))

    async def start(self, status: int, headers: list[tuple[str, str]], worker_url: str) -> None:
        self.response = web.StreamResponse(status=status, headers=self._headers(headers, worker_url))
        await self.response.prepare(self._request)

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        await self.response.write(chunk)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def error(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        self.response = json_error(status, message, type=type, param=param, code=code)


class FrontSink:
    """A sink for a request ``HttpFront`` read: the answer goes straight to the caller's connection, a stream
    in chunked transfer coding."""

    __slots__ = ("_front",)

    def __init__(self, front: HttpFront):
        self._front = front

    @staticmethod
    def _head(status: int, headers: list[tuple[str, str]], worker_url: str) -> bytearray:
        head = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status)))
        for name, value in headers:
            if name.lower() not in HOP_HEADERS:
                head += f"{name}: {value}\r\n".encode("latin-1")
        head += _WORKER_HEADER_PREFIX + worker_url.encode() + b"\r\n"
        return head

    def answer(self, status: int, headers: list[tuple[str, str]], worker_url: str, body: bytes) -> None:
        head = self._head(status, headers, worker_url)
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        head += body
        self._front.write(head)

    async def start(self, status: int, headers: list[tuple[str, str]], worker_url: str) -> None:
        head = self._head(status, headers, worker_url)
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        self._front.write(head)

    async def write(self, chunk: bytes) -> None:
        self._front.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await self._front.drain()

    async def end(self) -> None:
        self._front.write(b"0\r\n\r\n")

    def error(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        self._front.write(error_bytes(status, message, type=type, param=param, code=code))
