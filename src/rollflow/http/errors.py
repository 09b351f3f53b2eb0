"""The JSON errors of every rollflow listener: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status (``rollflow.errors.error_body``), as aiohttp responses (``json_error``, ``json_errors_middleware``) or as
raw HTTP/1.1 bytes for code that writes straight to a transport (``raw_json_response``, ``raw_error_response``).
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web

from rollflow.errors import error_body

log = structlog.get_logger(__name__)


def json_error(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """The JSON error response of every rollflow listener (``rollflow.errors.error_body``)."""
    return web.json_response(error_body(status, message, type=type, param=param, code=code), status=status)


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's HTTP exceptions (404, 405, 413 …) and unexpected errors into JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return json_error(exc.status, f"{request.method} {request.path}: {message}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("unhandled error in request handler", path=request.path)
        return json_error(500, f"internal error: {exc!r}")


def reason_phrase(status: int) -> bytes:
    """The status line's reason phrase for ``status`` (``Status`` for a code without one)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Status"


def raw_json_response(
    status: int, body: bytes, *, close: bool = False, content_type: bytes = b"application/json"
) -> bytes:
    """A complete HTTP/1.1 response with the JSON ``body``, written straight to a transport where no aiohttp
    response object can be used; ``close`` adds ``Connection: close``."""
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status,
        reason_phrase(status),
        content_type,
        len(body),
        b"Connection: close\r\n" if close else b"",
        body,
    )


def raw_error_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying the JSON error, that closes the connection."""
    return raw_json_response(status, json.dumps(error_body(status, message)).encode(), close=True)
