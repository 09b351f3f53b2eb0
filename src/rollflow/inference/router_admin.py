"""The router's admin and observability endpoints: the bearer check, ``/health``, ``/metrics`` (Prometheus
text), ``/list_workers``, ``/add_worker``, ``/remove_worker`` and ``/finish_session``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
from aiohttp import web

from rollflow.http.auth import bearer_token_matches
from rollflow.http.errors import json_error
from rollflow.inference.router_workers import RouterWorker
from rollflow.inference.session_ids import (
    SessionField,
    SessionIdError,
    check_body_session_id,
    session_id_from_raw_headers,
)

# Paths open without the bearer token (probes and scrapers carry no secret).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class RouterAdmin:
    """The admin half of ``InferenceRouter``: its aiohttp handlers over the router's server table. The router
    provides the state below and the membership calls (``add_worker``, ``remove_worker``,
    ``finish_session``)."""

    api_key: str | None
    workers: dict[str, RouterWorker]
    num_requests: int
    num_retries: int
    num_errors: int
    num_refused_too_large: int
    num_dead_engines: int
    _sessions: OrderedDict[str, str]

    def add_worker(self, url: str) -> bool:
        raise NotImplementedError

    def remove_worker(self, url: str) -> bool:
        raise NotImplementedError

    def finish_session(self, session_id: str) -> bool:
        raise NotImplementedError

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if (
            self.api_key
            and request.path not in OPEN_PATHS
            and not bearer_token_matches(request.headers.get("Authorization"), self.api_key)
        ):
            return json_error(401, "missing or wrong bearer token; send 'Authorization: Bearer <api key>'")
        return await handler(request)

    async def _url_param(self, request: web.Request) -> str | web.Response:
        url = request.query.get("url")
        if url is None and request.can_read_body:
            try:
                data = msgspec.json.decode(await request.read())
            except (msgspec.DecodeError, RecursionError) as error:
                return json_error(400, f"request body is not valid JSON: {error}")
            url = data.get("url") if isinstance(data, dict) else None
        if url is None:
            return json_error(400, "missing server URL: give ?url=http://host:port", param="url")
        return url

    async def _handle_add_worker(self, request: web.Request) -> web.Response:
        """``POST /add_worker?url=``: route to one more server. Behind the API key when one is set; without
        one, open to whoever reaches the router (local users on loopback), and the server added receives
        prompts."""
        url = await self._url_param(request)
        if isinstance(url, web.Response):
            return url
        try:
            added = self.add_worker(url)
        except ValueError as error:
            return json_error(400, str(error), param="url")
        return web.json_response({"status": "added" if added else "exists", "url": url.rstrip("/")})

    async def _handle_remove_worker(self, request: web.Request) -> web.Response:
        url = await self._url_param(request)
        if isinstance(url, web.Response):
            return url
        if not isinstance(url, str) or not self.remove_worker(url):
            return json_error(404, f"no such worker: {url!r}", param="url")
        return web.json_response({"status": "removed", "url": url.rstrip("/")})

    async def _handle_finish_session(self, request: web.Request) -> web.Response:
        try:
            session_id = check_body_session_id(
                request.query.get("session_id")
            ) or session_id_from_raw_headers(request.raw_headers)
        except SessionIdError as error:
            return json_error(400, str(error), param=error.param)
        if session_id is None and request.can_read_body:
            try:
                fields = msgspec.json.decode(await request.read(), type=SessionField)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as error:
                return json_error(400, f"invalid request body: {error}", param="session_id")
            try:
                session_id = check_body_session_id(fields.session_id)
            except SessionIdError as error:
                return json_error(400, str(error), param=error.param)
        if not session_id:
            return json_error(400, "missing session_id: give ?session_id=…", param="session_id")
        found = self.finish_session(session_id)
        return web.json_response({"status": "finished", "session_id": session_id, "found": found})

    async def _handle_health(self, request: web.Request) -> web.Response:
        healthy = sum(worker.healthy for worker in self.workers.values())
        if not healthy:
            return json_error(503, f"no healthy inference server (of {len(self.workers)})")
        return web.json_response({"status": "ok", "healthy_workers": healthy, "workers": len(self.workers)})

    def worker_table(self) -> list[dict[str, Any]]:
        """One dict per server: url, healthy, engine_dead, stale (why it is kept out, or None), outstanding,
        requests, failures, sessions."""
        return [
            {
                "url": worker.url,
                "healthy": worker.healthy,
                "engine_dead": worker.engine_dead,
                "stale": worker.stale,
                "outstanding": worker.outstanding,
                "requests": worker.requests,
                "failures": worker.failures,
                "sessions": worker.sessions,
            }
            for worker in self.workers.values()
        ]

    async def _handle_list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": self.worker_table()})

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP rollflow_router_requests_total Proxied requests.",
            "# TYPE rollflow_router_requests_total counter",
            f"rollflow_router_requests_total {self.num_requests}",
            "# HELP rollflow_router_retries_total Requests retried on another server after a connection error.",
            "# TYPE rollflow_router_retries_total counter",
            f"rollflow_router_retries_total {self.num_retries}",
            "# HELP rollflow_router_errors_total Requests that failed on every server tried.",
            "# TYPE rollflow_router_errors_total counter",
            f"rollflow_router_errors_total {self.num_errors}",
            "# HELP rollflow_router_refused_too_large_total Generation requests over --max-request-sequences.",
            "# TYPE rollflow_router_refused_too_large_total counter",
            f"rollflow_router_refused_too_large_total {self.num_refused_too_large}",
            "# HELP rollflow_router_dead_engines_total Servers taken out because their engine died.",
            "# TYPE rollflow_router_dead_engines_total counter",
            f"rollflow_router_dead_engines_total {self.num_dead_engines}",
            "# HELP rollflow_router_sessions Sessions pinned to a server.",
            "# TYPE rollflow_router_sessions gauge",
            f"rollflow_router_sessions {len(self._sessions)}",
        ]
        per_worker = (
            ("worker_healthy", "gauge", "1 if the server passes health checks.", "healthy"),
            (
                "worker_engine_dead",
                "gauge",
                "1 if the server was taken out because its engine died.",
                "engine_dead",
            ),
            ("worker_outstanding_requests", "gauge", "Requests in flight on the server.", "outstanding"),
            ("worker_requests_total", "counter", "Requests sent to the server.", "requests"),
            ("worker_failures_total", "counter", "Connection failures of the server.", "failures"),
            ("worker_sessions", "gauge", "Sessions pinned to the server.", "sessions"),
        )
        table = self.worker_table()
        for name, kind, help_text, key in per_worker:
            lines += [f"# HELP rollflow_router_{name} {help_text}", f"# TYPE rollflow_router_{name} {kind}"]
            lines += [f'rollflow_router_{name}{{worker="{row["url"]}"}} {int(row[key])}' for row in table]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
