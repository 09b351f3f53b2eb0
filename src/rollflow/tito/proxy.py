"""``TITOProxy``: an OpenAI-compatible Chat Completions server that records exactly what was sampled.

Owned by a generator (``async with TITOProxy(...) as proxy``). Each agent session gets its own unguessable
base URL, ``http://127.0.0.1:PORT/sessions/<token>/v1`` (``advertise_url`` replaces the address part for
agents that reach the proxy by another one), serving ``/chat/completions``, ``/responses`` (OpenAI's Responses
API), ``/messages`` and ``/messages/count_tokens`` (Anthropic's Messages API) and ``/models``: three wire formats
over one turn pipeline (``rollflow.tito.apis``); the agent changes nothing but that URL. ``close_session`` drains the session's requests, seals its trace, tells the inference
client the session is over (``finish_session``: a router forgets the session's server) and returns the trace
for ``compose``.

With an ``admin_token`` (the standalone ``rollflow proxy`` command) it also serves, behind
``Authorization: Bearer <token>``: ``POST /sessions`` (→ ``session_id``, ``base_url``),
``GET /sessions/{id}/trace``, and ``POST /sessions/{id}/close`` (``reward``, ``mode``, ``max_seq_len`` →
composed samples as JSON), so agents in any language and tests from outside can drive it. A close that
arrives while another close of the session drains waits for it and returns samples of the same sealed
trace; a close after the session is closed is a 409.

Sessions are bounded: at most ``max_sessions`` are open at once (``agent.max_sessions``; opening one more is
a 429 ``too_many_sessions``, ``RequestError`` in process), and a session without a request in flight for
``session_idle_timeout_s`` (``agent.session_idle_timeout_s``) is closed as timed out, its trace sealed; its
URL then answers 409 saying it expired. Each open session holds its trace and bookkeeping (about 5 KB empty)
until it is closed, so without these an agent that never closes its sessions grows the proxy for good.

HTTP contract: every error is JSON ``{"error": {"message", "type", "param", "code"}}`` (on ``/messages``
Anthropic's ``{"type": "error", "error": {"type", "message"}}``). Bad input is a 4xx
(400 naming the field, 404 unknown model or session, 409 closed session, 413 body too large); a 5xx is a bug,
except 503 when inference itself is gone. A client that disconnects cancels its request, which aborts the
engine request. This module imports neither torch nor transformers.

Serving cost: a non-streamed turn of any of the three APIs (chat completion, response, message) is read and
answered by the listener's own small HTTP/1.1 front (``rollflow.http.front``) rather than aiohttp's server,
through the same ``prepare_*`` and ``answer_turn`` as the aiohttp routes, so the same checks, the same session
and the same errors in each API's shape; everything else (streams, ``/models``, ``count_tokens``, admin
endpoints, bodies that do not decode or translate) is served by aiohttp on the same port.
``benchmarks/tito_load.py`` measures the proxy against calling the engine directly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import re
import secrets
import time
from collections.abc import Callable, Container, Coroutine, Mapping
from typing import Any

import anyio
import msgspec
import structlog
from aiohttp import web

from rollflow.errors import RequestError, error_body
from rollflow.http.auth import bearer_token_matches
from rollflow.http.errors import raw_json_response
from rollflow.http.front import Header, HttpFront, count_connections, serve_with_front, stop_listening
from rollflow.http.limits import HttpLimits
from rollflow.http.runner import JSONErrorAppRunner
from rollflow.inference.client import InferenceClient
from rollflow.inference.prompt_limits import max_prompt_chars, message_text_chars, prompt_too_long_message
from rollflow.tito.apis.anthropic import count_tokens, create_message, prepare_message
from rollflow.tito.apis.chat import prepare_chat
from rollflow.tito.apis.common import (
    TurnRequest,
    answer_turn,
    error_answer,
    request_key,
    serve_request,
    thinking_switch_unused,
)
from rollflow.tito.apis.responses import prepare_response
from rollflow.tito.composer import COMPOSE_MODES, compose, trace_metrics
from rollflow.tito.renderer import TITORenderer
from rollflow.tito.session import Session, TurnSettings
from rollflow.tito.side_calls import SideCallRule
from rollflow.tito.trace import Trace
from rollflow.tito.wire import DecodedRequest, ModelCard, ModelList

log = structlog.get_logger(__name__)

_ENCODER = msgspec.json.Encoder()
# Closed sessions' tokens are remembered (to answer 409 rather than 404) up to this many.
_MAX_CLOSED_REMEMBERED = 100_000
_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SESSION_PREFIX = "/sessions/"
# The endpoints (under a session's URL) whose non-streamed turns the front answers, each by its API's
# ``prepare_*`` (the same the aiohttp route uses).
_FAST_ENDPOINTS: dict[str, Callable[[Any, Session, bytes], TurnRequest]] = {
    "v1/chat/completions": prepare_chat,
    "v1/responses": prepare_response,
    "v1/messages": prepare_message,
}
_FAST_SUFFIXES = tuple("/" + endpoint for endpoint in _FAST_ENDPOINTS)
# Defaults of agent.max_sessions and agent.session_idle_timeout_s.
DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_SESSION_IDLE_TIMEOUT_S = 3600.0
# The idle sweep runs this often, as a fraction of the idle timeout (and at least once a minute).
_SWEEPS_PER_TIMEOUT = 4


def claim_session_id(session_id: str | None, *taken: Container[str]) -> str:
    """``session_id`` for a new session (a random one when None), once checked against each of ``taken``:
    the ids of open sessions and of remembered closed ones.

    Raises:
        ValueError: ``session_id`` is taken, or not 1-128 letters, digits, '.', '_', '-'.
    """
    if session_id is None:
        return f"s-{secrets.token_hex(8)}"
    if not _SESSION_ID.fullmatch(session_id):
        raise ValueError(f"session_id {session_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
    if any(session_id in ids for ids in taken):
        raise ValueError(f"session_id {session_id!r} is already in use")
    return session_id


def remember_closed(
    closed: collections.OrderedDict[str, str | None], *keys: str, reason: str | None = None
) -> None:
    """Add ``keys`` to the closed sessions' ids and tokens ``closed``, forgetting the oldest past a bound;
    ``reason`` is what a later request to them is told (None: that the session is closed)."""
    for key in keys:
        closed[key] = reason
    while len(closed) > _MAX_CLOSED_REMEMBERED:
        closed.popitem(last=False)


class CloseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of the admin ``POST /sessions/{id}/close``."""

    reward: float
    max_seq_len: int
    mode: str = "per_branch"
    filter_overlong: bool = False
    # What became of the agent: it failed (error message) or ran out of time.
    error: str | None = None
    timed_out: bool = False


class OpenRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of the admin ``POST /sessions`` (may be empty)."""

    session_id: str | None = None


def _encode(data: Any) -> bytes:
    """A response body as JSON (both the aiohttp path and the front's)."""
    return _ENCODER.encode(data)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(data), status=status, content_type="application/json")


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    return _json(error_body(status, message, param=param, code=code), status)


def _enc_hook(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays (routed experts)
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


class TITOProxy:
    """The proxy server (see the module docstring).

    Args:
        client: where generation runs; the session id is passed along for router affinity.
        renderer: a ``renderers`` renderer (or a ``TITORenderer``) for the served model.
        tokenizer: the model's tokenizer (decodes single tokens for ``logprobs`` output).
        model_name: the name requests must use in ``model`` (others get 404).
        host, port: where to listen; port 0 picks a free port (``proxy.port`` tells which).
        advertise_url: the base URL agents are given instead of ``http://{host}:{port}`` (a container
            network, a port mapping); the session paths are appended to it.
        admin_token: enables the admin endpoints behind this bearer token.
        max_body_bytes: larger request bodies get 413.
        drain_timeout_s: how long ``close_session`` waits for requests in flight before cancelling them.
        default_max_tokens, default_temperature, default_top_p: sampling when a request does not say.
        enforce_sampling: sample at ``default_temperature``, ``default_top_p`` and ``default_top_k`` whatever a
            request asks (training: the trainer's PPO ratio assumes them); overridden requests are counted in
            the trace's ``stats.sampling_overridden``.
        max_model_len: the engines' context length, if known: a request whose message text alone cannot fit
            it is a 400 (``context_length_exceeded``) before it is rendered (``rollflow.inference.
            prompt_limits``). Large requests are rendered in a worker thread either way.
        http_limits: read timeouts and the connection cap (``rollflow.http.limits.HttpLimits``).
        default_top_k: top_k when a request gives none (and always, with ``enforce_sampling``).
        strict_requests: refuse (400) request fields the proxy does not know and values it cannot enforce
            (``tool_choice: "required"``), instead of ignoring and counting them (``stats.unknown_fields``,
            ``stats.ignored_values``).
        max_n: the most replies one request may ask for (``n``); more is a 400.
        return_routed_experts: the engines return MoE routed experts (``inference.return_routed_experts``):
            a reply with stop strings is then sampled whole and cut, so that its routes are kept.
        max_sessions: the most sessions open at once; ``open_session`` beyond it raises ``RequestError``
            (HTTP 429, code ``too_many_sessions``).
        session_idle_timeout_s: seconds a session may go without a request in flight before it is closed as
            timed out (checked every quarter of it, at least once a minute).
        side_calls: which calls are side calls (``rollflow.tito.side_calls``): answered, recorded untrained
            and counted per kind; its model names are served too. None: every call is trainable.
    """

    def __init__(
        self,
        client: InferenceClient,
        renderer: Any,
        tokenizer: Any,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: str | None = None,
        max_body_bytes: int = 16 * 2**20,
        drain_timeout_s: float = 30.0,
        default_max_tokens: int = 1024,
        default_temperature: float = 1.0,
        default_top_p: float = 1.0,
        enforce_sampling: bool = False,
        max_model_len: int | None = None,
        http_limits: HttpLimits | None = None,
        default_top_k: int = -1,
        strict_requests: bool = False,
        max_n: int = 16,
        advertise_url: str | None = None,
        return_routed_experts: bool = False,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S,
        side_calls: SideCallRule | None = None,
    ):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        if isinstance(session_idle_timeout_s, bool) or not (
            isinstance(session_idle_timeout_s, int | float) and session_idle_timeout_s > 0
        ):  # inf: sessions never expire
            raise ValueError(
                f"session_idle_timeout_s must be a positive number of seconds, got {session_idle_timeout_s!r}"
            )
        # Swappable components.
        self.client = client
        self.renderer = renderer if isinstance(renderer, TITORenderer) else TITORenderer(renderer, tokenizer)
        # Fixed settings.
        self.settings = TurnSettings(
            model_name,
            default_max_tokens,
            default_temperature,
            default_top_p=default_top_p,
            enforce_sampling=enforce_sampling,
            default_top_k=default_top_k,
            return_routed_experts=return_routed_experts,
        )
        self.strict_requests = strict_requests
        self.side_calls = side_calls if side_calls is not None and side_calls.active else None
        self.max_n = max_n
        self.host = host
        self.port = port
        self.advertise_url = advertise_url.rstrip("/") if advertise_url else None
        self.admin_token = admin_token
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_s = drain_timeout_s
        self.max_model_len = max_model_len
        self.http_limits = http_limits or HttpLimits()
        self.max_prompt_chars = (
            None if max_model_len is None else max_prompt_chars(max_model_len, self.renderer.tokenizer)
        )
        self.max_sessions = max_sessions
        self.session_idle_timeout_s = float(session_idle_timeout_s)
        # What a request to an expired session is told (one string for all of them).
        self._expired_reason = (
            f"this session expired: it had no request for {self.session_idle_timeout_s:g} s "
            "(agent.session_idle_timeout_s); open a new session"
        )
        # Runtime state.
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.fronts: set[HttpFront] = set()  # connections the hot path serves (see http_front)
        self._sessions: dict[str, Session] = {}  # by URL token
        self._by_id: dict[str, Session] = {}
        # Closed sessions' tokens and ids, with what a request to them is told (None: that it is closed).
        self._closed: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None
        self.num_expired_sessions = 0

    @property
    def base_url(self) -> str:
        """Where the proxy listens."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def public_url(self) -> str:
        """The base URL agents are given: ``advertise_url``, else ``base_url``."""
        return self.advertise_url or self.base_url

    @property
    def model_name(self) -> str:
        """The model name agents pass (``model``), as ``ProxyWorkers.model_name``."""
        return self.settings.model_name

    @property
    def sessions(self) -> list[Session]:
        """Open sessions."""
        return list(self._by_id.values())

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind and serve. If binding fails, everything started so far is released before raising.

        Raises:
            OSError: the address is in use or cannot be bound.
        """
        app = web.Application(middlewares=[self._errors], client_max_size=self.max_body_bytes)
        chat_completions = functools.partial(serve_request, prepare_chat, self)
        app.router.add_post("/sessions/{token}/v1/chat/completions", chat_completions)
        app.router.add_get("/sessions/{token}/v1/models", self._models)
        # Harnesses probe their base URL before the first call (Claude Code sends HEAD): an open session is up.
        app.router.add_get("/sessions/{token}", self._models)
        app.router.add_get("/sessions/{token}/v1", self._models)
        app.router.add_post(
            "/sessions/{token}/v1/responses", functools.partial(serve_request, prepare_response, self)
        )
        app.router.add_post("/sessions/{token}/v1/messages", functools.partial(create_message, self))
        app.router.add_post(
            "/sessions/{token}/v1/messages/count_tokens", functools.partial(count_tokens, self)
        )
        if self.admin_token is not None:
            app.router.add_post("/sessions", self._admin_open)
            app.router.add_get("/sessions/{session_id}/trace", self._admin_trace)
            app.router.add_post("/sessions/{session_id}/close", self._admin_close)
        # handler_cancellation: a client disconnect cancels its handler, which aborts the engine request.
        runner = JSONErrorAppRunner(
            app, limits=self.http_limits, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        # Every connection starts with the hot-path front, which hands it to aiohttp's handler at its first
        # request the front does not serve.
        assert runner.server is not None
        try:
            self._server = await serve_with_front(self, runner.server, self.host, self.port)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.get_running_loop().create_task(self._expire_idle_sessions())
        log.debug("tito proxy listening", base_url=self.base_url)

    async def close(self) -> None:
        """Close every open session (draining each), then the listener and its connections. Idempotent.
        The listener is released also when this is cancelled (then without waiting for the drains)."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        try:
            for session in list(self._by_id.values()):
                await self.close_session(session)
        finally:
            stop_listening(self._server, self.fronts)
            self._server = None
            if self._runner is not None:
                runner, self._runner = self._runner, None
                with anyio.CancelScope(shield=True):
                    await runner.cleanup()

    async def __aenter__(self) -> TITOProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ sessions

    async def open_session(self, session_id: str | None = None) -> Session:
        """A new session with its own base URL; ``session_id`` defaults to a random one.

        Raises:
            ValueError: ``session_id`` is already in use, or not 1-128 letters, digits, '.', '_', '-'.
            RequestError: ``max_sessions`` sessions are open already (status 429, code ``too_many_sessions``).
        """
        if len(self._by_id) >= self.max_sessions:
            raise too_many_sessions(len(self._by_id), self.max_sessions)
        session_id = claim_session_id(session_id, self._by_id, self._closed)
        token = secrets.token_urlsafe(24)
        base_url = f"{self.public_url}/sessions/{token}/v1"
        session = Session(session_id, token, base_url, self.client, self.renderer, self.settings)
        self._sessions[token] = session
        self._by_id[session_id] = session
        return session

    def get_session(self, session_id: str) -> Session | None:
        """The open session with this id, or None."""
        return self._by_id.get(session_id)

    async def close_session(
        self,
        session: Session,
        *,
        error: str | None = None,
        timed_out: bool = False,
        drain_timeout_s: float | None = None,
    ) -> Trace:
        """Refuse new requests (409), wait for those in flight (up to ``drain_timeout_s``, default the
        proxy's; then they are cancelled), record how the agent ended, seal the trace and return it.
        Closing a closed session returns its trace again; a close while another one drains waits for it,
        so both return the sealed trace (the second close's ``error`` and ``timed_out`` are ignored)."""
        trace = session.trace
        if session.closed:
            if session.close_done is not None:
                await asyncio.shield(session.close_done)
            return trace
        session.closed = True
        session.close_done = asyncio.get_running_loop().create_future()
        try:
            await session.drain(self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
        finally:
            # Also when the drain was cancelled; later operations then fail with 409.
            trace.end(error=error, timed_out=timed_out)
            self._sessions.pop(session.token, None)
            self._by_id.pop(session.session_id, None)
            remember_closed(self._closed, session.token, session.session_id)
            session.close_done.set_result(None)
        finish_session = getattr(self.client, "finish_session", None)
        if finish_session is not None:  # a router forgets which server the session was pinned to
            await finish_session(session.session_id)
        return trace

    async def _expire_idle_sessions(self) -> None:
        """Close, as timed out, every session that has had no request in flight for
        ``session_idle_timeout_s``; runs while the proxy listens."""
        timeout_s = self.session_idle_timeout_s
        interval_s = min(timeout_s / _SWEEPS_PER_TIMEOUT, 60.0)
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            idle = [s for s in self._by_id.values() if not s.closed and s.idle_for_s(now) >= timeout_s]
            for session in idle:
                if session.closed or session.idle_for_s(time.monotonic()) < timeout_s:
                    continue  # closed, or a request came, while an earlier one was being closed
                log.info("closing an idle tito session", session=session.session_id, idle_timeout_s=timeout_s)
                try:
                    await self.close_session(
                        session, error=self._expired_reason, timed_out=True, drain_timeout_s=0
                    )
                except Exception:  # one session's close (its finish_session) must not end the sweep
                    log.exception("closing an idle tito session failed", session=session.session_id)
                self.num_expired_sessions += 1
                for key in (session.token, session.session_id):
                    if key in self._closed:
                        self._closed[key] = self._expired_reason

    # ------------------------------------------------------------------ HTTP: errors

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as error:
            return _error(error.status, error.reason or error.text or "")
        except Exception as error:
            return _json(*reversed(error_answer(error)))

    def session_for(self, request: web.Request) -> Session:
        token = request.match_info["token"]
        session = self._sessions.get(token)
        if session is None:
            if token in self._closed:
                reason = self._closed[token] or "this session is closed"
                raise RequestError(reason, status=409, code="session_closed")
            raise RequestError("unknown session", status=404, code="session_not_found")
        return session

    async def read_body(self, request: web.Request) -> bytes:
        length = request.headers.get("Content-Length")
        if length is not None:
            if not length.isdigit():
                raise RequestError(f"malformed Content-Length {length!r}", code="invalid_content_length")
            if int(length) > self.max_body_bytes:
                raise RequestError(
                    f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                    status=413,
                    code="request_too_large",
                )
        return await request.read()  # aiohttp answers 413 beyond client_max_size (chunked bodies too)

    # ------------------------------------------------------------------ HTTP: agent endpoints

    async def _models(self, request: web.Request) -> web.Response:
        self.session_for(request)
        return _json(ModelList([ModelCard(self.settings.model_name, int(time.time()))]))

    def admit(
        self,
        session: Session,
        decoded: DecodedRequest,
        body: bytes,
        idempotency_key: str | None,
        retry_count: str | None,
        *,
        api: str = "chat",
        headers: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
    ) -> tuple[str | None, bool]:
        """The checks of a decoded chat completion before it is sampled; its (request key, is_retry). Whether
        it is a side call (``side_calls``, from ``api``, the model and ``headers``, or a function making them)
        is set on ``decoded.side_call``.

        Raises:
            RequestError: the prompt cannot fit, the model is not served here, or an ``Idempotency-Key`` is
                reused with another body.
        """
        chat = decoded.request
        if self.side_calls is not None:
            found = (headers() if callable(headers) else headers) or {}
            lower = {name.lower(): value for name, value in found.items()}
            decoded.side_call = self.side_calls.kind(api, chat.model, lower, chat)
        thinking = (chat.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is not None and self.renderer.variant(enable_thinking=thinking) is None:
            decoded.ignored_values.append(thinking_switch_unused(self.strict_requests))
        if decoded.unknown_fields or decoded.ignored_values:
            session.trace.count_ignored(decoded.unknown_fields, decoded.ignored_values)
        if self.max_prompt_chars is not None:
            chars = message_text_chars(chat.messages)
            if chars > self.max_prompt_chars:
                assert self.max_model_len is not None
                session.trace.stats.context_exceeded += 1  # counted like the engine's own refusal
                raise RequestError(
                    prompt_too_long_message(chars, self.max_prompt_chars, self.max_model_len),
                    param="messages",
                    code="context_length_exceeded",
                )
        served = chat.model == self.settings.model_name or (
            decoded.side_call is not None and decoded.side_call == self.side_calls.model_kind(chat.model)
        )
        if not served:
            raise RequestError(
                f"model {chat.model!r} is not served here; use {self.settings.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        key, is_retry = request_key(idempotency_key, retry_count, body)
        if key is not None and key.startswith("key:"):
            # The key names one request: replaying its reply for another body would answer the wrong one.
            digest = hashlib.blake2b(body, digest_size=16).digest()
            if session.key_digests.setdefault(key, digest) != digest:
                raise RequestError(
                    f"Idempotency-Key {key[4:]!r} was already used with a different request body in this "
                    "session; send a new key with a new request (a retry must resend the same body)",
                    status=422,
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
        return key, is_retry

    # ------------------------------------------------------------------ HTTP: the front's hot path

    def open_connections(self) -> int:
        """Connections open to the proxy: those of its hot-path front and those handed to aiohttp."""
        return count_connections(self.fronts, self._runner)

    def accepts(self, path: str) -> bool:
        return path.startswith(_SESSION_PREFIX) and path.endswith(_FAST_SUFFIXES)

    def fast_request(
        self, front: HttpFront, path: str, headers: list[Header], body: bytes
    ) -> Coroutine[Any, Any, None] | None:
        """A non-streamed turn (Chat Completions, Responses, Messages) of an open session that decodes is
        answered from the front; anything else (unknown or closed sessions, streams, bodies that do not decode
        or translate) aiohttp serves, answering as always."""
        token, _, endpoint = path[len(_SESSION_PREFIX) :].partition("/")
        session = self._sessions.get(token)
        prepare = _FAST_ENDPOINTS.get(endpoint)
        if session is None or prepare is None:
            return None
        try:
            turn_request = prepare(self, session, body)
        except Exception:  # aiohttp decodes it again and answers the error in the API's shape
            return None
        if turn_request.stream:
            return None
        idempotency_key = retry_count = None
        for lower, _, value in headers:
            # The first of a repeated header, as aiohttp's ``headers.get`` reads it.
            if lower == b"idempotency-key" and idempotency_key is None:
                idempotency_key = value.decode("latin-1")
            elif lower == b"x-stainless-retry-count" and retry_count is None:
                retry_count = value.decode("latin-1")

        def header_map() -> dict[str, str]:  # made only when side-call rules read headers
            return {lower.decode("latin-1"): value.decode("latin-1") for lower, _, value in reversed(headers)}

        answer = answer_turn(self, session, turn_request, body, idempotency_key, retry_count, header_map)
        return self._answer_fast(front, turn_request, answer)

    async def _answer_fast(
        self, front: HttpFront, turn_request: TurnRequest, answer: Coroutine[Any, Any, Any]
    ) -> None:
        """A turn's answer (or its error, in its API's shape) written straight to the front's connection."""
        try:
            status, data = 200, await answer
        except Exception as error:
            status, data = turn_request.error_answer(error)
        front.write(raw_json_response(status, _encode(data), close=front.close_after))

    # ------------------------------------------------------------------ HTTP: admin endpoints

    def _authorize(self, request: web.Request) -> None:
        assert self.admin_token is not None  # the admin routes exist only with a token
        if not bearer_token_matches(request.headers.get("Authorization"), self.admin_token):
            raise RequestError("missing or wrong bearer token", status=401, code="unauthorized")

    def _admin_session(self, request: web.Request) -> Session:
        session_id = request.match_info["session_id"]
        session = self._by_id.get(session_id)
        if session is None:
            if session_id in self._closed:
                reason = self._closed[session_id] or "this session is closed"
                raise RequestError(f"session {session_id!r}: {reason}", status=409, code="session_closed")
            raise RequestError(f"unknown session {session_id!r}", status=404, code="session_not_found")
        return session

    async def _admin_open(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self.read_body(request)
        try:
            params = msgspec.json.decode(body or b"{}", type=OpenRequest)
            session = await self.open_session(params.session_id)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError) as error:
            raise RequestError(f"invalid session request: {error}", param="session_id") from None
        return _json({"session_id": session.session_id, "base_url": session.base_url})

    async def _admin_trace(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return _json(self._admin_session(request).trace.to_dict())

    async def _admin_close(self, request: web.Request) -> web.Response:
        self._authorize(request)
        session = self._admin_session(request)
        body = await self.read_body(request)
        try:
            params = msgspec.json.decode(body, type=CloseRequest)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as error:
            raise RequestError(f"invalid close request: {error}") from None
        if params.mode not in COMPOSE_MODES:
            raise RequestError(
                f"mode must be one of {', '.join(COMPOSE_MODES)}, got {params.mode!r}", param="mode"
            )
        if params.max_seq_len < 1:
            raise RequestError(f"max_seq_len must be >= 1, got {params.max_seq_len}", param="max_seq_len")
        trace = await self.close_session(session, error=params.error, timed_out=params.timed_out)
        samples = compose(
            trace,
            reward=params.reward,
            mode=params.mode,
            max_seq_len=params.max_seq_len,
            filter_overlong=params.filter_overlong,
        )
        body = msgspec.json.encode(
            {"samples": samples, "metrics": trace_metrics(trace, samples)}, enc_hook=_enc_hook
        )
        return web.Response(body=body, content_type="application/json")


def too_many_sessions(open_sessions: int, max_sessions: int) -> RequestError:
    """The 429 for a session opened beyond ``max_sessions``."""
    return RequestError(
        f"the TITO proxy has {open_sessions} sessions open, its limit (agent.max_sessions = {max_sessions}); "
        "close finished sessions first (POST /sessions/{id}/close), or raise agent.max_sessions",
        status=429,
        code="too_many_sessions",
        type="RateLimitError",
    )
