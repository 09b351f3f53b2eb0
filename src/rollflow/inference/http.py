"""Small aiohttp helpers shared by rollflow's HTTP listeners: vLLM-style JSON errors everywhere.

aiohttp answers requests it cannot parse (a bad ``Content-Length``, a malformed request line) from its protocol
layer with a plain-text body before any handler runs; ``JSONErrorAppRunner`` makes those JSON too, so every
error a client can cause is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """vLLM/OpenAI error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def json_error(
    status: int, message: str, *, type: str | None = None, param: str | None = None
) -> web.Response:
    """A vLLM-shaped JSON error response."""
    body = {"error": {"message": message, "type": type or error_type(status), "param": param, "code": status}}
    return web.json_response(body, status=status)


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


class _JSONErrorRequestHandler(RequestHandler):
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


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JSONErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JSONErrorAppRunner(web.AppRunner):
    """An ``AppRunner`` whose protocol-level errors (unparseable requests) are JSON, like handler errors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer
        return server
