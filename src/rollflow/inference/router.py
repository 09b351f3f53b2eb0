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
- A proxied request answered by a dead engine (503 ``EngineDeadError``) takes that server out at once and is
  retried on another, so no session pinned to it sees the 503. Servers taken out for a dead engine are counted
  (``rollflow_router_dead_engines_total``). With every server's engine dead the router answers 503
  ``EngineDeadError`` itself, so clients stop waiting as they would for a pause.
- A proxied request that fails on the connection before any response byte reached the caller is retried once
  on another server. All proxied endpoints are treated as idempotent: generation keeps no server state the
  caller could observe, and the failed attempt returned nothing.

Control plane: vLLM's control endpoints (pause, sleep, weight transfer, world size …) fan out to every healthy
server, so the router can also be a client's whole control plane; see ``rollflow.inference.router_control``.

Data-plane cost: a request naming its session in the ``X-Session-ID`` header passes through unread (only a
request without it has its body decoded, for ``session_id``), read and answered by the router's own small
HTTP/1.1 front (``rollflow.http.front``) rather than aiohttp's server; it goes out with the caller's raw headers over a
kept-alive connection of ``rollflow.http.upstream.UpstreamPool``, a client leaner than aiohttp's.
``benchmarks/router_compare.py`` measures it against vllm-router and direct calls.

Admin and observability: ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /list_workers``,
``POST /add_worker?url=``, ``POST /remove_worker?url=``. Streaming responses (``"stream": true``) are passed
through chunk by chunk. Errors are vLLM-shaped JSON; bad input is a 4xx.

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
from urllib.parse import urlsplit

import aiohttp
import msgspec
import structlog
from aiohttp import web

from rollflow.errors import ENGINE_DEAD_TYPE, error_body
from rollflow.http.auth import bearer_token_matches, warn_if_exposed
from rollflow.http.errors import json_error, json_errors_middleware, raw_json_response
from rollflow.http.front import Header, HttpFront, count_connections, serve_with_front, stop_listening
from rollflow.http.limits import HttpLimits
from rollflow.http.runner import JSONErrorAppRunner
from rollflow.http.upstream import UpstreamError, UpstreamPool
from rollflow.inference.router_control import CONTROL_GET, CONTROL_POST, handle_control
from rollflow.inference.router_sinks import HOP_HEADERS, AiohttpSink, FrontSink, ResponseSink
from rollflow.inference.router_sinks import WORKER_HEADER as WORKER_HEADER
from rollflow.inference.session_ids import (
    SessionIdError,
    check_body_session_id,
    decode_session_id_header,
    session_id_from_raw_headers,
)

log = structlog.get_logger(__name__)

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
# Paths open without the bearer token (probes and scrapers carry no secret).
OPEN_PATHS = frozenset({"/health", "/metrics"})
_HEALTH_PROBE = msgspec.json.encode(
    {
        "token_ids": [0],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        "request_id": "router-health",
    }
)


# Timed-out probes in a row, with the server neither paused nor making progress, that take it out as hung:
# one could be a burst that filled the engine's batch; two, a health_check_timeout_s apart, are a stall.
HUNG_PROBES = 2


class _SessionField(msgspec.Struct):
    """The only body field the router reads; decoding into it also checks the body is a JSON object."""

    session_id: str | None = None


def _hash(key: str) -> int:
    # surrogatepass: a JSON body may carry a lone surrogate (``"\ud800"``); it still hashes.
    return int.from_bytes(
        hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def validate_server_url(url: Any) -> str:
    """``http(s)://host[:port]`` without a path, normalized (no trailing slash).

    Raises:
        ValueError: anything else; the message says what is wrong.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"server URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server URL must look like http://host:port, got {url!r}")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"server URL must have no path or query (give the server's base URL), got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port outside 0-65535
    except ValueError:
        raise ValueError(f"server URL has an invalid port: {url!r}") from None
    return url.rstrip("/")


def _forwarded_headers(headers: Any) -> dict[str, str]:
    """``headers`` less the hop-by-hop ones (checked against their lower-case names, built once)."""
    return {name: value for name, value in headers.items() if name.lower() not in HOP_HEADERS}


def _forwarded_raw_headers(raw_headers: Any) -> list[tuple[bytes, bytes]]:
    """The request's header lines as received (bytes), less the hop-by-hop ones."""
    return [(name, value) for name, value in raw_headers if name.lower() not in _HOP_HEADER_BYTES]


def _is_engine_dead(status: int, body: bytes) -> bool:
    """Whether an answer says the server's engine died: 503 with error ``type`` ``EngineDeadError``."""
    if status != 503 or not body:
        return False
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == ENGINE_DEAD_TYPE


class _Worker:
    __slots__ = (
        "engine_dead",
        "failures",
        "healthy",
        "hung_probes",
        "last_progress",
        "outstanding",
        "requests",
        "sessions",
        "stale",
        "url",
    )

    def __init__(self, url: str):
        self.url = url
        self.healthy = True
        self.engine_dead = False  # taken out because the server said its engine died
        self.stale: str | None = None  # kept out: the policy version it serves, unlike the others'
        self.hung_probes = 0  # probes in a row that timed out with the server neither paused nor busy
        self.last_progress = 0.0  # loop time a proxied answer last began, streamed or ended
        self.outstanding = 0
        self.requests = 0
        self.failures = 0  # proxied requests that failed on the connection
        self.sessions = 0  # sessions pinned to it in the router's table, kept exact by _pin/_unpin


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


class InferenceRouter:
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
    ):
        self.host = host
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
        self.workers: dict[str, _Worker] = {}
        for url in server_urls:
            url = validate_server_url(url)
            self.workers[url] = _Worker(url)
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
            connector=aiohttp.TCPConnector(limit=0),
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
        self.workers[url] = _Worker(url)
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

    def _pin(self, session_id: str, worker: _Worker) -> None:
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

    def _mark_dead(self, worker: _Worker, reason: str, *, engine_dead: bool = False) -> None:
        if engine_dead and not worker.engine_dead:
            worker.engine_dead = True
            self.num_dead_engines += 1
        if worker.healthy:
            worker.healthy = False
            self._forget_sessions_of(worker.url)
            self._rebuild_ring()
            pool = self._pools.get(worker.url)
            given_up = pool.abort(f"{worker.url} was taken out: {reason}") if pool is not None else 0
            log.warning("worker taken out", worker=worker.url, reason=reason, requests_given_up=given_up)

    async def _answered_probe(self, worker: _Worker) -> None:
        """``worker`` answered a probe: back into rotation, unless it serves a stale policy version."""
        if worker.healthy or worker.url not in self.workers:
            return
        stale = await self._stale_version(worker)
        if stale is not None:
            if worker.stale != stale:
                log.warning("worker kept out", worker=worker.url, reason=stale)
            worker.stale = stale
            return
        self._mark_alive(worker)

    def _mark_alive(self, worker: _Worker) -> None:
        if not worker.healthy and worker.url in self.workers:
            worker.healthy = True
            worker.engine_dead = False
            worker.stale = None
            self._rebuild_ring()
            log.info("worker back in", worker=worker.url)

    async def _stale_version(self, worker: _Worker) -> str | None:
        """Why ``worker`` must stay out though it answers: it serves another policy version than the servers
        in rotation (it was down while they took a weight update). None when it may rejoin: the same version,
        no server in rotation to compare with, or a server that cannot say (no ``/weight_info``)."""
        in_rotation = [w for w in self.workers.values() if w.healthy]
        if not in_rotation:
            return None
        versions = await asyncio.gather(*(self._weight_version(w) for w in [worker, *in_rotation]))
        own, others = versions[0], {v for v in versions[1:] if v is not None}
        if own is None or not others or own in others:
            return None
        return (
            f"it serves policy version {own} and the servers in rotation {', '.join(sorted(others))}: it was "
            "down during a weight update; push weights to it again (restart it, or restart the run's "
            "weight sync) to bring it back"
        )

    async def _weight_version(self, worker: _Worker) -> str | None:
        """``/weight_info``'s ``weight_version`` of ``worker``, None when it cannot tell."""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/weight_info", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                if response.status != 200:
                    return None
                version = (await response.json()).get("weight_version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        return None if version is None else str(version)

    def _ring_lookup(self, session_id: str, exclude: set[str]) -> _Worker | None:
        """A new session's server: the first on the ring walk from its hash, not excluded, below the load
        bound (see the module docstring); the first not excluded when every one is at the bound (only possible
        with some excluded)."""
        if not self._ring:
            return None
        # Counts on healthy servers only: every pinned session is on one (dead ones' are forgotten).
        bound = math.ceil(self.balance_factor * (len(self._sessions) + 1) / self._healthy)
        ring, size = self._ring, len(self._ring)
        start = bisect.bisect(self._ring_keys, _hash(session_id))
        fallback: _Worker | None = None
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

    def _least_loaded(self, exclude: set[str]) -> _Worker | None:
        candidates = [w for w in self.workers.values() if w.healthy and w.url not in exclude]
        if not candidates:
            return None
        # Rotate the start so ties spread round-robin instead of always hitting the first server.
        self._tie_breaker += 1
        offset = self._tie_breaker % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda worker: worker.outstanding)

    def pick(self, session_id: str | None, exclude: set[str] | None = None) -> _Worker | None:
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
                fields = msgspec.json.decode(body, type=_SessionField)
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

    def _pool(self, worker: _Worker) -> UpstreamPool:
        pool = self._pools.get(worker.url)
        if pool is None:
            pool = self._pools[worker.url] = UpstreamPool(
                worker.url, connect_timeout_s=self.connect_timeout_s
            )
        return pool

    def _upstream_failed(self, worker: _Worker, error: UpstreamError) -> None:
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
        worker: _Worker,
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
                    if _is_engine_dead(upstream.status, data):
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

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            await asyncio.gather(*(self._probe(worker) for worker in list(self.workers.values())))

    async def _probe(self, worker: _Worker) -> None:
        """Ask ``worker`` for one token; mark it dead or alive from the answer."""
        assert self._client is not None
        started = asyncio.get_running_loop().time()
        try:
            async with self._client.post(
                f"{worker.url}/inference/v1/generate",
                data=_HEALTH_PROBE,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(
                    total=self.health_check_timeout_s, sock_connect=self.connect_timeout_s
                ),
            ) as response:
                body = await response.read()
                if _is_engine_dead(response.status, body):
                    self._mark_dead(worker, "its engine died (health probe)", engine_dead=True)
                    return
                # 503: paused in abort/wait mode, alive. Other 4xx: alive but rejecting the probe (logged).
                alive = response.status < 500 or response.status == 503
                if 400 <= response.status < 500:
                    log.debug("health probe rejected", worker=worker.url, status=response.status)
        except aiohttp.ClientConnectorError as error:
            self._mark_dead(worker, f"health probe could not connect: {error}")
            return
        except TimeoutError:
            reason = await self._why_hung(worker, since=started)
            if reason is None:
                await self._answered_probe(worker)
            else:
                self._mark_dead(worker, reason)
            return
        except aiohttp.ClientError:
            alive = await self._answers_health(worker)
        if alive:
            worker.hung_probes = 0
            await self._answered_probe(worker)
        else:
            self._mark_dead(worker, "health probe failed")

    async def _why_hung(self, worker: _Worker, *, since: float) -> str | None:
        """After a probe that got no token within ``health_check_timeout_s``: why ``worker`` counts as hung,
        or None while it is not (yet). Paused (``keep`` mode queues the probe) and busy (an answer through the
        router began, streamed or ended since the probe was sent) are alive; a server that answers neither
        ``/is_paused`` nor ``/health`` is dead; one that answers but makes no progress is hung at the
        ``HUNG_PROBES``-th such probe in a row."""
        if worker.last_progress >= since:
            worker.hung_probes = 0
            return None
        paused = await self._is_paused(worker)
        if paused:
            worker.hung_probes = 0
            return None
        if paused is None and not await self._answers_health(worker):
            return "health probe failed"
        worker.hung_probes += 1
        if worker.hung_probes < HUNG_PROBES:
            return None
        return (
            f"its generation is hung: {worker.hung_probes} probes in a row got no token within "
            f"health_check_timeout_s = {self.health_check_timeout_s:g} s, and it is not paused and finished "
            "nothing meanwhile"
        )

    async def _is_paused(self, worker: _Worker) -> bool | None:
        """``/is_paused`` of ``worker``: False when it has no such endpoint (it cannot be paused), None when it
        did not answer."""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/is_paused", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                if response.status == 404:
                    return False
                if response.status != 200:
                    return None
                return bool((await response.json()).get("is_paused"))
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    async def _answers_health(self, worker: _Worker) -> bool:
        """A slow probe may just be a busy or keep-paused server: does ``GET /health`` still answer 200?"""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/health", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # ------------------------------------------------------------------ admin endpoints

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
                fields = msgspec.json.decode(await request.read(), type=_SessionField)
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


async def serve_router(router: InferenceRouter, ready: Any = None) -> None:
    """Run ``router`` until cancelled; ``ready(url)`` is called once it listens (the CLI prints the line)."""
    url = await router.start()
    try:
        if ready is not None:
            ready(url)
        await asyncio.Event().wait()
    finally:
        await router.stop()
