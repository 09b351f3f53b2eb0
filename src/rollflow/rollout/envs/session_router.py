"""One loopback endpoint in front of many TITO sessions, routed by a request header.

verifiers' interception server builds one model client per distinct endpoint config and keeps it for the
whole run; giving each trajectory its session URL as the endpoint would make (and load CA certificates for,
tens of ms of CPU) one HTTP client per trajectory. Instead every episode's endpoint is this router, and each
request goes to the session its ``X-Session-ID`` header (the verifiers trace id, which the interception
server sends with every call) was routed to. An unrouted id is answered 404, so it fails its episode
instead of reaching another trajectory's session.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

SESSION_HEADER = "X-Session-ID"
# Request headers not copied upstream: the hop's own framing, and the (dummy) credential.
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "authorization"})


class SessionRouter:
    """``async with SessionRouter() as router``: listens on 127.0.0.1 (``base_url``); ``route(key, url)``
    sends requests whose ``X-Session-ID`` is ``key`` to the session base URL ``url``
    (``…/sessions/<token>/v1``), ``unroute(key)`` stops it."""

    def __init__(self) -> None:
        self._routes: dict[str, str] = {}
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.base_url = ""

    def route(self, key: str, session_url: str) -> None:
        self._routes[key] = session_url.rstrip("/")

    def unroute(self, key: str) -> None:
        self._routes.pop(key, None)

    async def __aenter__(self) -> SessionRouter:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        target = self._routes.get(request.headers.get(SESSION_HEADER, ""))
        if target is None:
            message = f"no trajectory session is routed for {SESSION_HEADER} = {request.headers.get(SESSION_HEADER)!r}"
            return web.json_response(
                {
                    "error": {
                        "message": message,
                        "type": "NotFoundError",
                        "param": None,
                        "code": "session_not_found",
                    }
                },
                status=404,
            )
        assert self._http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        url = f"{target}/{request.match_info['tail']}"
        async with self._http.request(
            request.method, url, data=await request.read(), headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for (
                chunk
            ) in upstream.content.iter_any():  # streamed (SSE) answers pass through as they come
                await response.write(chunk)
            await response.write_eof()
            return response
