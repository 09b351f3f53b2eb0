"""``InferenceRouter``: a session-aware reverse proxy in front of vLLM-compatible inference servers.

Routing:
- A request with a session (header ``X-Session-ID``, else a ``session_id`` string in the JSON body) sticks to
  one server, so a multi-turn session keeps hitting the server that holds its prefix cache. A new session is
  placed by consistent hashing with bounded loads over the healthy servers (64 virtual nodes each): it walks
  the ring from its hash and takes the first server holding fewer than
  ``ceil(balance_factor * (pinned + 1) / healthy servers)`` sessions. It is then remembered until
  ``POST /finish_session`` (or until the table's LRU bound), so adding a server or a shift in balance never
  moves a live session.
- Why the bound defaults to ``balance_factor = 1.0`` (servers differ by at most one session): the session
  table already gives stickiness, so the ring is only a preference order for sessions nobody holds yet. Plain
  consistent hashing splits few sessions unevenly (64 sessions over 2 servers: 35/29 at the median of 200
  random port pairs, 45/19 at the worst), and in a closed loop of agents on servers with devices of their own
  the busier server sets the pace. (On one 2-core machine whose servers, router and load generator share the
  cores, ``benchmarks/router_compare.py --balance-factor 1e9`` read no throughput difference against the plain
  ring.) A larger factor lets more sessions follow their ring point (same server after the table forgot them,
  e.g. a router restart) at the cost of balance; a very large one is plain consistent hashing.
- A request without a session goes to the healthy server with the fewest outstanding requests.
- Session ids are read by ``rollflow.inference.session_ids`` on every path (the header as UTF-8, at most
  ``MAX_SESSION_ID_BYTES``; anything else is a 400 before anything is pinned), and a request the server
  refused (4xx) pins no new session.

Failure handling:
- Every ``health_check_interval_s`` each server must generate one token (``/inference/v1/generate``,
  ``max_tokens`` 1). A refused connection marks it dead at once. A probe past ``health_check_timeout_s``
  counts as alive while the server is paused (``/is_paused``: ``keep`` mode queues the probe) or while
  requests through the router still finish or stream from it (busy, not stuck); otherwise its generation is
  hung, and after ``HUNG_PROBES`` such probes in a row (its ``/health`` may still answer) it is taken out.
  A 503 counts as alive (paused in ``abort``/``wait`` mode) unless its error ``type`` is ``EngineDeadError``:
  the server answers but its engine died, which is a dead server (so is a 500, vLLM's answer once its engine
  died). Dead servers leave the hash ring, their sessions are re-placed on their next request, and they
  rejoin once a probe succeeds, unless they serve another policy version than the servers in rotation
  (``/weight_info``: one that was down during a weight update); such a server stays out, ``stale``.
- Taking a server out gives up the requests in flight to it (their connections are closed): one whose
  answer had not started is retried on another server as below, a stream already under way breaks, rather
  than every caller waiting ``request_timeout_s`` for a server that will not answer.
- A proxied request answered by a dead engine (503 ``EngineDeadError``, or vLLM's 500 once its engine core
  died: ``rollflow.inference.vllm_errors``) takes that server out at once and is retried on another, so no session pinned to it sees the 503. Servers taken out for a dead engine are counted
  (``rollflow_router_dead_engines_total``). With every server's engine dead the router answers 503
  ``EngineDeadError`` itself, so clients stop waiting as they would for a pause.
- A proxied request that fails on the connection before any response byte reached the caller is retried once
  on another server. All proxied endpoints are treated as idempotent: generation keeps no server state the
  caller could observe, and the failed attempt returned nothing.

Control plane: vLLM's control endpoints (pause, sleep, weight transfer, world size …) fan out to every healthy
server, so the router can also be a client's whole control plane; see ``rollflow.inference.router_control``.

Data-plane cost: a request naming its session in the ``X-Session-ID`` header passes through with only its
work read (``n``, its prompts counted, not decoded: ``request_limits.sequences_asked``, refused over
``max_request_sequences`` with a 400 ``request_too_large``; only a request without the header has its body
decoded, for ``session_id``), read and answered by the router's own small
HTTP/1.1 front (``rollflow.http.front``) rather than aiohttp's server; it goes out with the caller's raw headers over a
kept-alive connection of ``rollflow.http.upstream.UpstreamPool``, a client leaner than aiohttp's.
``benchmarks/router_compare.py`` measures it against vllm-router and direct calls.

Admin and observability: ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /list_workers``,
``POST /add_worker?url=``, ``POST /remove_worker?url=``. Streaming responses (``"stream": true``) are passed
through chunk by chunk. Errors are vLLM-shaped JSON; bad input is a 4xx.

Where the parts live: routing, the proxy and the lifecycle here; health checks in ``router_health``, admin
endpoints in ``router_admin``, the control fan-out in ``router_control``, the two response sinks of the one
forward path in ``router_sinks``, and the server table entry (``RouterWorker``) in ``router_workers``.

With an ``api_key`` every path but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <api_key>``
(401 otherwise), and the router sends the same header to the servers (proxied calls, probes, fan-out), so
one key guards router and servers alike.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import hmac
import math
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from rollflow.errors import ENGINE_DEAD_TYPE, error_body
from rollflow.http.auth import warn_if_exposed
from rollflow.http.errors import json_error, json_errors_middleware, raw_json_response
from rollflow.http.front import Header, HttpFront, count_connections, serve_with_front, stop_listening
from rollflow.http.limits import HttpLimits
from rollflow.http.runner import JSONErrorAppRunner
from rollflow.http.upstream import CLIENT_KEEPALIVE_S, UpstreamError, UpstreamPool
from rollflow.inference.request_limits import (
    DEFAULT_MAX_SEQUENCES,
    REQUEST_TOO_LARGE,
    RequestLimits,
    request_work_error,
    sequences_asked,
)
from rollflow.inference.router_admin import OPEN_PATHS as OPEN_PATHS
from rollflow.inference.router_admin import RouterAdmin
from rollflow.inference.router_control import CONTROL_GET, CONTROL_POST, handle_control
from rollflow.inference.router_health import HUNG_PROBES as HUNG_PROBES
from rollflow.inference.router_health import RouterHealth
from rollflow.inference.router_sinks import HOP_HEADERS, AiohttpSink, FrontSink, ResponseSink
from rollflow.inference.router_sinks import WORKER_HEADER as WORKER_HEADER
from rollflow.inference.router_workers import RouterWorker, is_engine_dead, validate_server_url
from rollflow.inference.session_ids import (
    SessionField,
    SessionIdError,
    check_body_session_id,
    decode_session_id_header,
    session_id_from_raw_headers,
)

log = structlog.get_logger(__name__)
# The router's server table entry under the name rollflow.inference.router_control imports.
_Worker = RouterWorker

VIRTUAL_NODES = 64
# Data-plane routes proxied to one server; every other path is a 404.
PROXIED_POST = (
    "/inference/v1/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
)
PROXIED_GET = ("/v1/models",)
_HOP_HEADER_BYTES = frozenset(name.encode() for name in HOP_HEADERS)


def _hash(key: str) -> int:
    # surrogatepass: a JSON body may carry a lone surrogate (``"\ud800"``); it still hashes.
    return int.from_bytes(
        hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def _forwarded_headers(headers: Any) -> dict[str, str]:
    """``headers`` less the hop-by-hop ones (checked against their lower-case names, built once)."""
    return {name: value for name, value in headers.items() if name.lower() not in HOP_HEADERS}


def _forwarded_raw_headers(raw_headers: Any) -> list[tuple[bytes, bytes]]:
    """The request's header lines as received (bytes), less the hop-by-hop ones."""
    return [(name, value) for name, value in raw_headers if name.lower() not in _HOP_HEADER_BYTES]


def validate_balance_factor(value: Any) -> float:
    """``balance_factor`` as a float: a finite number >= 1.0.

    Raises:
        ValueError: anything else; the message names ``balance_factor``, the value and the fix.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 1.0
    ):
        raise ValueError(
            f"balance_factor must be a finite number >= 1.0 (1.0: servers differ by at most one session; "
            f"larger: closer to plain consistent hashing), got {value!r}"
        )
    return float(value)


class InferenceRouter(RouterHealth, RouterAdmin):
    """Session-aware reverse proxy over inference servers (see the module docstring).

    Args:
        server_urls: base URLs of the servers (more can be added at runtime with ``/add_worker``).
        host: interface to bind; 127.0.0.1 unless you mean to expose the router.
        port: port to bind; 0 picks a free one (read ``url`` after ``start``).
        health_check_interval_s: seconds between health probes of each server.
        health_check_timeout_s: longest a probe may take before ``/health`` decides.
        request_timeout_s: longest one proxied request may take.
        connect_timeout_s: longest connecting to a server may take before it counts as unreachable.
        max_body_bytes: larger request bodies get 413.
        max_sessions: sessions remembered at most (least recently used are forgotten first).
        balance_factor: a new session goes to the first server on its ring walk holding fewer than
            ``ceil(balance_factor * (pinned + 1) / healthy servers)`` sessions; a finite number >= 1.0. The
            default 1.0 keeps servers within one session of each other, so a closed loop of sessions loads
            them evenly (the session table, not the ring, keeps sessions sticky); a very large value is plain
            consistent hashing.
        api_key: when set, every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <api_key>``, and the
            router sends it to the servers too. Without one, ``/add_worker`` lets whoever reaches the router
            add a server that then receives prompts: bound to loopback (the default), that is any local user;
            bound elsewhere, ``start`` logs a warning.
        http_limits: read timeouts and the connection cap (``rollflow.http.limits.HttpLimits``).

    Raises:
        ValueError: a server URL or ``balance_factor`` is invalid.

    Use ``async with InferenceRouter(urls) as router:`` or ``await router.start()`` / ``await router.stop()``.
    """

    def __init__(
        self,
        server_urls: list[str] | tuple[str, ...] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        health_check_interval_s: float = 2.0,
        health_check_timeout_s: float = 10.0,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_body_bytes: int = 64 * 1024 * 1024,
        max_sessions: int = 100_000,
        balance_factor: float = 1.0,
        api_key: str | None = None,
        http_limits: HttpLimits | None = None,
        max_request_sequences: int | None = DEFAULT_MAX_SEQUENCES,
    ):
        self.host = host
        # The most sequences (prompts x n) one generation request may ask for; None: the servers decide.
        self.request_limits = (
            None if max_request_sequences is None else RequestLimits(max_sequences=max_request_sequences)
        )
        self.http_limits = http_limits or HttpLimits()
        self.port = port
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        self.max_sessions = max_sessions
        self.balance_factor = validate_balance_factor(balance_factor)
        self.api_key = api_key
        self.workers: dict[str, RouterWorker] = {}
        for url in server_urls:
            url = validate_server_url(url)
            self.workers[url] = RouterWorker(url)
        # Routing state.
        self._ring: list[tuple[int, str]] = []
        self._ring_keys: list[int] = []
        self._healthy = 0  # servers on the ring
        # session id -> URL of its server; every owner is a healthy server (dead or removed ones are forgotten).
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._tie_breaker = 0
        self._rebuild_ring()
        # Counters for /metrics.
        self.num_requests = 0
        self.num_retries = 0
        self.num_errors = 0
        self.num_refused_too_large = 0  # generation requests over max_request_sequences
        self.num_dead_engines = 0  # times a server was taken out because its engine died
        # Runtime.
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None  # probes and the control plane
        self._pools: dict[str, UpstreamPool] = {}  # the data plane: kept-alive connections per server
        self._health_task: asyncio.Task[None] | None = None
        self._server: asyncio.Server | None = None
        self.fronts: set[HttpFront] = set()  # connections the hot path serves (see http_front)
        self._fast_paths = frozenset(PROXIED_POST)
        self._api_key_bytes = api_key.encode() if api_key else None
        self.url: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind and start serving and health-checking; returns the router's URL.

        Raises:
            OSError: the port could not be bound.
        """
        self._client = aiohttp.ClientSession(
            # Kept-alive connections to the servers are reused, without a cap; no cookie jar (a proxy holds
            # no cookies of its own, and filtering them costs every request).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
            auto_decompress=False,  # bodies pass through byte for byte, with their Content-Encoding
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None,
        )
        app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=[json_errors_middleware, self._auth_middleware]
        )
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/list_workers", self._handle_list_workers)
        app.router.add_post("/add_worker", self._handle_add_worker)
        app.router.add_post("/remove_worker", self._handle_remove_worker)
        app.router.add_post("/finish_session", self._handle_finish_session)
        for path in PROXIED_POST:
            app.router.add_post(path, self._handle_proxy)
        for path in PROXIED_GET:
            app.router.add_get(path, self._handle_proxy)
        for path in CONTROL_POST:
            app.router.add_post(path, self._handle_control)
        for path in CONTROL_GET:
            app.router.add_get(path, self._handle_control)
        # handler_cancellation: a caller that disconnects cancels the upstream request, so the server
        # sees the disconnect and aborts the engine request.
        self._runner = JSONErrorAppRunner(
            app, limits=self.http_limits, access_log=None, handler_cancellation=True
        )
        await self._runner.setup()
        # Every connection starts with the hot-path front, which hands it to aiohttp's handler
        # (``self._runner.server``) at its first request the hot path does not serve.
        handoff = self._runner.server
        assert handoff is not None
        try:
            self._server = await serve_with_front(self, handoff, self.host, self.port)
        except BaseException:
            await self.stop()
            raise
        bound_port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{bound_port}"
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        log.info("router started", url=self.url, workers=list(self.workers))
        warn_if_exposed("rollflow router", self.host, self.api_key)
        return self.url

    async def stop(self) -> None:
        """Stop health checks and serving; close upstream connections. Idempotent."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        stop_listening(self._server, self.fronts)
        self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def __aenter__(self) -> InferenceRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def open_connections(self) -> int:
        """Connections open to the router: those of its hot-path front and those handed to aiohttp."""
        return count_connections(self.fronts, self._runner)

    # ------------------------------------------------------------------ the front's hot path (FrontHost)

    def accepts(self, path: str) -> bool:
        return path.partition("?")[0] in self._fast_paths

    def fast_request(
        self, front: HttpFront, path: str, headers: list[Header], body: bytes
    ) -> Coroutine[Any, Any, None] | None:
        """A proxied POST naming its session once in ``X-Session-ID`` (with the bearer token when an API key is
        set) is proxied from and to the socket; anything else aiohttp serves as it always did (sessions named in
        the body, 401 …)."""
        session_id: str | None = None
        refused: SessionIdError | None = None
        authorization: bytes | None = None
        forwarded: list[tuple[bytes, bytes]] = []
        for lower, name, value in headers:
            if lower == b"x-session-id":
                if session_id is not None or refused is not None:
                    return None  # named twice: aiohttp's path reads the first, as it always did
                try:
                    session_id = decode_session_id_header(value)
                except SessionIdError as error:
                    refused = error
            elif lower == b"authorization":
                authorization = value
            if lower not in _HOP_HEADER_BYTES:
                forwarded.append((name, value))
        if not session_id and refused is None:
            return None
        if self._api_key_bytes is not None:
            scheme, _, token = authorization.partition(b" ") if authorization else (b"", b"", b"")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self._api_key_bytes):
                return None  # aiohttp's middleware answers 401
        if refused is not None:
            # Answered here: aiohttp would refuse a header line over 8 KB with its own, vaguer 400.
            return self._refuse_fast(front, refused)
        assert session_id is not None
        return self._route(FrontSink(front), session_id, "POST", path, forwarded, body)

    @staticmethod
    async def _refuse_fast(front: HttpFront, error: SessionIdError) -> None:
        body = msgspec.json.encode(error_body(400, str(error), param=error.param))
        front.write(raw_json_response(400, body, content_type=b"application/json; charset=utf-8"))

    # ------------------------------------------------------------------ membership and routing

    def add_worker(self, url: str) -> bool:
        """Add a server (healthy until a probe says otherwise); False if it was already there.

        Raises:
            ValueError: ``url`` is not an ``http(s)://host:port`` base URL.
        """
        url = validate_server_url(url)
        if url in self.workers:
            return False
        self.workers[url] = RouterWorker(url)
        self._rebuild_ring()
        log.info("worker added", worker=url)
        return True

    def remove_worker(self, url: str) -> bool:
        """Remove a server and forget its sessions; False if it was not there."""
        url = url.rstrip("/") if isinstance(url, str) else url
        if url not in self.workers:
            return False
        del self.workers[url]
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.close()
        self._forget_sessions_of(url)
        self._rebuild_ring()
        log.info("worker removed", worker=url)
        return True

    def finish_session(self, session_id: str) -> bool:
        """Forget ``session_id`` (its next request is placed as a new session); whether it was pinned."""
        return self._unpin(session_id)

    def _rebuild_ring(self) -> None:
        ring = [
            (_hash(f"{url}#{index}"), url)
            for url, worker in self.workers.items()
            if worker.healthy
            for index in range(VIRTUAL_NODES)
        ]
        ring.sort()
        self._ring = ring
        self._ring_keys = [key for key, _ in ring]
        self._healthy = len(ring) // VIRTUAL_NODES

    def _pin(self, session_id: str, worker: RouterWorker) -> None:
        """Remember ``session_id`` on ``worker`` (as most recently used), forgetting the least recently used
        sessions beyond ``max_sessions``."""
        self._unpin(session_id)
        self._sessions[session_id] = worker.url
        worker.sessions += 1
        while len(self._sessions) > self.max_sessions:
            _, owner = self._sessions.popitem(last=False)
            self._count_off(owner)

    def _unpin(self, session_id: str) -> bool:
        """Forget ``session_id``; whether it was pinned."""
        owner = self._sessions.pop(session_id, None)
        if owner is None:
            return False
        self._count_off(owner)
        return True

    def _count_off(self, owner: str) -> None:
        worker = self.workers.get(owner)
        if worker is not None:
            worker.sessions -= 1

    def _forget_sessions_of(self, url: str) -> None:
        for session_id in [sid for sid, owner in self._sessions.items() if owner == url]:
            del self._sessions[session_id]
        worker = self.workers.get(url)
        if worker is not None:
            worker.sessions = 0

    def _ring_lookup(self, session_id: str, exclude: set[str]) -> RouterWorker | None:
        """A new session's server: the first on the ring walk from its hash, not excluded, below the load
        bound (see the module docstring); the first not excluded when every one is at the bound (only possible
        with some excluded)."""
        if not self._ring:
            return None
        # Counts on healthy servers only: every pinned session is on one (dead ones' are forgotten).
        bound = math.ceil(self.balance_factor * (len(self._sessions) + 1) / self._healthy)
        ring, size = self._ring, len(self._ring)
        start = bisect.bisect(self._ring_keys, _hash(session_id))
        fallback: RouterWorker | None = None
        seen: set[str] = set()
        for offset in range(size):
            url = ring[(start + offset) % size][1]
            if url in seen:
                continue
            seen.add(url)
            if url not in exclude:
                worker = self.workers[url]
                if worker.sessions < bound:
                    return worker
                if fallback is None:
                    fallback = worker
            if len(seen) == self._healthy:
                break
        return fallback

    def _least_loaded(self, exclude: set[str]) -> RouterWorker | None:
        candidates = [w for w in self.workers.values() if w.healthy and w.url not in exclude]
        if not candidates:
            return None
        # Rotate the start so ties spread round-robin instead of always hitting the first server.
        self._tie_breaker += 1
        offset = self._tie_breaker % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda worker: worker.outstanding)

    def pick(self, session_id: str | None, exclude: set[str] | None = None) -> RouterWorker | None:
        """The server for a request: sticky per session (a new or re-placed session by consistent hashing
        with bounded loads), else least outstanding; None if none is healthy."""
        exclude = exclude or set()
        if not session_id:
            return self._least_loaded(exclude)
        owner = self._sessions.get(session_id)
        if owner is not None:
            worker = self.workers.get(owner)
            if worker is not None and worker.healthy and owner not in exclude:
                self._sessions.move_to_end(session_id)
                return worker
            # Re-placed (its server is excluded for this retry): off the old count before the bound is taken.
            self._unpin(session_id)
        worker = self._ring_lookup(session_id, exclude)
        if worker is not None:
            self._pin(session_id, worker)
        return worker

    # ------------------------------------------------------------------ proxy

    async def _handle_proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # over client_max_size: 413 via the middleware
        try:
            session_id = session_id_from_raw_headers(request.raw_headers)
        except SessionIdError as error:
            return json_error(400, str(error), param=error.param)
        # The hot path: with the session in the header the body passes through unread (the server
        # validates it); only a request without one is decoded, for a ``session_id`` field.
        if session_id is None and request.method == "POST":
            try:
                fields = msgspec.json.decode(body, type=SessionField)
            except msgspec.ValidationError as error:
                return json_error(400, f"invalid request body: {error}", param="session_id")
            except msgspec.DecodeError as error:
                return json_error(400, f"request body is not valid JSON: {error}")
            except RecursionError:  # skipping a deeply nested field hits msgspec's depth limit
                return json_error(400, "request body JSON is nested too deeply to decode; flatten it")
            try:
                session_id = check_body_session_id(fields.session_id)
            except SessionIdError as error:
                return json_error(400, str(error), param=error.param)
        sink = AiohttpSink(request)
        headers = _forwarded_raw_headers(request.raw_headers)
        await self._route(sink, session_id, request.method, request.path_qs, headers, body, path=request.path)
        assert sink.response is not None
        return sink.response

    async def _route(
        self,
        sink: ResponseSink,
        session_id: str | None,
        method: str,
        path_qs: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        path: str | None = None,
    ) -> None:
        """Send a request to the session's server, and once more elsewhere when that one failed before
        answering (``_forward``); with no server left to try, ``sink`` gets the router's own error. ``path`` is
        the path errors name (``path_qs`` less its query by default).

        A session this request placed is forgotten again when the server refused the request (4xx): a
        refused request opens no session, and pinning it would let refused requests fill the table."""
        self.num_requests += 1
        asked = sequences_asked(path or path_qs.partition("?")[0], body) if self.request_limits else None
        if asked and (refusal := request_work_error(self.request_limits, *asked, limiter="this router")):
            self.num_refused_too_large += 1
            sink.error(400, refusal[0], param=refusal[1], code=REQUEST_TOO_LARGE)
            return
        tried: set[str] = set()
        last_error = "no healthy inference server"
        new_session = session_id is not None and session_id not in self._sessions
        for attempt in range(2):
            worker = self.pick(session_id, tried)
            if worker is None:
                break
            tried.add(worker.url)
            if attempt:
                self.num_retries += 1
            result = await self._forward(sink, worker, method, path_qs, headers, body)
            if isinstance(result, int):
                if (
                    new_session
                    and 400 <= result < 500
                    and session_id is not None
                    and self._sessions.get(session_id) == worker.url
                ):
                    self._unpin(session_id)
                return
            last_error = f"{worker.url}: {result!r}"
        self.num_errors += 1
        what = f"{method} {path if path is not None else path_qs.partition('?')[0]}"
        if self.workers and all(worker.engine_dead for worker in self.workers.values()):
            message = (
                f"{what} failed: the engine of every inference server ({len(self.workers)}) is dead; "
                "restart them"
            )
            sink.error(503, message, type=ENGINE_DEAD_TYPE)
            return
        sink.error(503 if not tried else 502, f"{what} failed: {last_error}")

    def _pool(self, worker: RouterWorker) -> UpstreamPool:
        pool = self._pools.get(worker.url)
        if pool is None:
            pool = self._pools[worker.url] = UpstreamPool(
                worker.url, connect_timeout_s=self.connect_timeout_s
            )
        return pool

    def _upstream_failed(self, worker: RouterWorker, error: UpstreamError) -> None:
        worker.failures += 1
        if error.connect:
            self._mark_dead(worker, f"connection failed: {error}")
        else:
            # Maybe dying, maybe a broken connection: let a probe decide now rather than guess.
            asyncio.create_task(self._probe(worker))  # noqa: RUF006 - fire and forget; it only flips a flag

    async def _handle_control(self, request: web.Request) -> web.Response:
        return await handle_control(self, request, _forwarded_headers(request.headers))

    async def _forward(
        self,
        sink: ResponseSink,
        worker: RouterWorker,
        method: str,
        path_qs: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> int | BaseException:
        """Proxy to ``worker``, answering into ``sink``: the status answered, or the error when the connection
        failed before anything was sent back (the caller may retry elsewhere).

        The caller's headers go as they are: with an ``api_key`` the auth check already found that they carry
        it, so the server gets it too."""
        pool = self._pool(worker)
        worker.outstanding += 1
        worker.requests += 1
        started = False
        try:
            async with asyncio.timeout(self.request_timeout_s):
                upstream = await pool.request(method, path_qs, headers, body)
                loop = asyncio.get_running_loop()
                worker.last_progress = loop.time()
                if upstream.content_length is not None and "text/event-stream" not in upstream.content_type():
                    data = await upstream.read()
                    worker.last_progress = loop.time()
                    if is_engine_dead(upstream.status, data):
                        # Nothing reached the caller yet: take the server out and let the caller retry.
                        self._mark_dead(worker, "its engine died", engine_dead=True)
                        return RuntimeError(f"the engine of {worker.url} is dead")
                    sink.answer(upstream.status, upstream.headers, worker.url, data)
                    return upstream.status
                started = True
                await sink.start(upstream.status, upstream.headers, worker.url)
                async with contextlib.aclosing(upstream.iter_chunks()) as chunks:
                    async for chunk in chunks:
                        if chunk:
                            worker.last_progress = loop.time()
                            await sink.write(chunk)
                await sink.end()
                return upstream.status
        except UpstreamError as error:
            self._upstream_failed(worker, error)
            if started:
                raise
            return error
        except TimeoutError:
            if started:
                raise
            sink.error(
                504, f"{worker.url} did not answer within request_timeout_s = {self.request_timeout_s} s"
            )
            return 504
        finally:
            worker.outstanding -= 1


async def serve_router(router: InferenceRouter, ready: Any = None) -> None:
    """Run ``router`` until cancelled; ``ready(url)`` is called once it listens (the CLI prints the line)."""
    url = await router.start()
    try:
        if ready is not None:
            ready(url)
        await asyncio.Event().wait()
    finally:
        await router.stop()
