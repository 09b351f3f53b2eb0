"""``RemoteInferenceClient``: the ``InferenceClient`` protocol over vLLM-compatible HTTP servers.

Two planes, as in vLLM RL deployments:

- the **data plane** (generate, chat/completions, tokenize) goes to one URL, the router or an external proxy,
  with ``X-Session-ID`` when a request belongs to a session, so the router keeps a session on one server;
- the **control plane** (``client.control``, an ``HttpControlPlane``: pause, resume, sleep, weight transfer,
  world size) fans out to every server URL at once, each call bounded by ``control_timeout_s``; failures name
  the server.

A 503 from a paused server is waited out (within ``request_timeout_s``); a 503 whose error ``type`` is
``EngineDeadError`` (its engine died, or every engine behind a router), or vLLM's 500 after its engine core died
(``vllm_errors``), raises ``RemoteEngineDeadError`` at once instead of waiting for a resume that never comes.

Failures come in the same families as an in-process engine's (``rollflow.errors``, ``http_error``): a 4xx is an
``EngineError`` keeping the server's ``code`` (``context_length_exceeded`` is a
``ContextLengthExceededError``); connection errors past the retries, a 5xx, or 503s until the deadline are
``InferenceUnavailableError`` (retryable); a dead engine is an ``EngineDeadError``.

Paths and field names are vLLM 0.33's (``/inference/v1/generate``, ``/pause?mode=``, ``/update_weights`` …),
so the same client drives vLLM on GPUs and rollflow's torch engine server on CPUs. The client is picklable
(its aiohttp session is created lazily per event loop and dropped on pickling) so it can be shipped to other
processes. This module must not import torch at module scope.

The JSON of requests and answers is translated in ``remote_wire``; the data plane's retry policy is
``remote_retry``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import structlog

from rollflow.errors import (
    ControlPlaneError,
    RemoteEngineDeadError,
    RemoteInferenceError,
    RemoteUnavailableError,
)
from rollflow.http.sse import iter_sse
from rollflow.http.upstream import CLIENT_KEEPALIVE_S
from rollflow.inference.control import PauseMode, WorldSize
from rollflow.inference.remote_control import HttpControlPlane
from rollflow.inference.remote_retry import DataRetry
from rollflow.inference.remote_wire import (
    error_message,
    http_error,
    parse_generate,
    parse_stream_event,
    sampling_fields,
)
from rollflow.messages import GenerateChunk, GenerateOutput, GenerateRequest

log = structlog.get_logger(__name__)

# Generous: thousands of concurrent generate calls share one session (aiohttp's default of 100 throttles RL).
DEFAULT_CONNECTION_LIMIT = 10_000


class RemoteInferenceClient:
    """Drives vLLM-compatible inference servers over HTTP (see the module docstring).

    Args:
        data_url: base URL of the data plane: a router, an external proxy, or a single server.
        server_urls: base URLs of every server, for the control plane. Defaults to ``[data_url]`` (a proxy
            that is also the control plane).
        api_key: sent as ``Authorization: Bearer …`` on every call.
        model: the ``model`` field of generate requests (vLLM's served model name); None omits it.
        data_parallel_size: server URLs per deployment that each report the deployment's whole world size
            (vLLM with one HTTP server per DP rank); 1 when each URL is its own deployment.
        request_timeout_s: longest one data-plane call may take, including waiting while servers are paused.
        control_timeout_s: longest one control-plane call to one server may take. Weight-transfer calls block
            until the trainer's broadcast completes, so this bounds them too.
        connect_retries: data-plane retries after a connection error (refused, reset, disconnected).
        drop_unreachable_servers: a server that refuses connections, or answers that its engine died, during a
            control-plane fan-out is dropped from ``server_urls`` (logged) and the call succeeds on the rest;
            otherwise it is an error.
        connection_limit: most simultaneous connections (0: unlimited).
        policy_version: stamped on generated tokens when the server does not report per-token versions;
            ``control.finish_weight_update(policy_version)`` advances it.
    """

    def __init__(
        self,
        data_url: str,
        server_urls: Sequence[str] | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        data_parallel_size: int = 1,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
        connect_retries: int = 3,
        drop_unreachable_servers: bool = False,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
        policy_version: int = 0,
    ):
        server_urls = [data_url] if server_urls is None else list(server_urls)
        if not server_urls:
            raise ValueError("RemoteInferenceClient needs at least one server URL for the control plane")
        if data_parallel_size < 1 or len(server_urls) % data_parallel_size:
            raise ValueError(
                f"data_parallel_size ({data_parallel_size}) must be >= 1 and divide the number of server "
                f"URLs ({len(server_urls)})"
            )
        self.data_url = data_url.rstrip("/")
        self.server_urls = [url.rstrip("/") for url in server_urls]
        self.api_key = api_key
        self.model = model
        self.data_parallel_size = data_parallel_size
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_retries = connect_retries
        self.drop_unreachable_servers = drop_unreachable_servers
        self.connection_limit = connection_limit
        self.policy_version = policy_version
        #: The LoRA adapter requests name as their ``model`` instead of ``model`` (``serve_adapter``).
        self.adapter: str | None = None
        # Runtime state, never pickled.
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._world_size: WorldSize | None = None
        #: The servers' control plane (pause, sleep, world size, weight updates), fanned out to each URL.
        self.control = HttpControlPlane(self)

    # ------------------------------------------------------------------ plumbing

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_session"] = None
        state["_session_loop"] = None
        return state

    async def __aenter__(self) -> RemoteInferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (servers are left running; their owner stops them). Idempotent."""
        session, self._session, self._session_loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session belongs to one loop; a client used from another loop (after pickling, or from
            # a fresh asyncio.run) gets its own.
            connector = aiohttp.TCPConnector(
                limit=self.connection_limit, limit_per_host=0, keepalive_timeout=CLIENT_KEEPALIVE_S
            )
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None),
                json_serialize=lambda obj: msgspec.json.encode(obj).decode(),
            )
            self._session_loop = loop
        return self._session

    async def _request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        params: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> Any:
        """One HTTP call; returns the decoded JSON body (None for an empty one).

        Raises:
            RemoteInferenceError: a 4xx/5xx answer (with the server's message), a timeout, or a connection
                error (``status`` None; the cause is chained).
        """
        session = self._get_session()
        try:
            async with session.request(
                method,
                url,
                json=json,
                params=params,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                raw = await response.read()
                status = response.status
        except TimeoutError:
            raise RemoteUnavailableError(f"{method} {url} timed out after {timeout_s} s", url=url) from None
        except aiohttp.ClientConnectionError:
            raise  # callers decide: retry (data plane) or drop the server (control plane)
        except aiohttp.ClientError as error:
            raise RemoteUnavailableError(f"{method} {url} failed: {error!r}", url=url) from error
        body: Any = None
        if raw:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                body = None
        if status >= 400:
            message = error_message(body, raw.decode(errors="replace"))
            raise http_error(f"{method} {url} returned HTTP {status}: {message}", url, status, body)
        return body

    async def _data_call(
        self, method: str, path: str, *, json: Any = None, session_id: str | None = None
    ) -> Any:
        """A data-plane call: retried on connection errors (bounded) and while servers answer 503 (paused),
        within ``request_timeout_s`` overall."""
        url = f"{self.data_url}{path}"
        headers = {"X-Session-ID": session_id} if session_id else None
        retry = DataRetry(method, url, self.request_timeout_s, self.connect_retries)
        while True:
            remaining = retry.remaining()
            try:
                return await self._request(method, url, json=json, headers=headers, timeout_s=remaining)
            except aiohttp.ClientConnectionError as error:
                await retry.after_connection_error(error)
            except RemoteUnavailableError as error:
                if error.status != 503:
                    raise
                await (
                    retry.while_paused()
                )  # paused, or no healthy server yet (a dead engine is not waited for)

    async def _fan_out(
        self,
        action: str,
        call: Callable[[str], Awaitable[Any]],
    ) -> dict[str, Any]:
        """Run ``call(server_url)`` on every server concurrently; returns ``{url: body}``.

        Raises:
            ControlPlaneError: naming every server that failed (after dropping unreachable ones, if enabled).
        """
        urls = list(self.server_urls)
        results = await asyncio.gather(*(call(url) for url in urls), return_exceptions=True)
        answers: dict[str, Any] = {}
        failures: dict[str, RemoteInferenceError] = {}
        unreachable: list[str] = []
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, aiohttp.ClientConnectionError):
                unreachable.append(url)
                failures[url] = RemoteUnavailableError(f"unreachable: {result!r}", url=url)
            elif isinstance(result, RemoteEngineDeadError):
                unreachable.append(url)  # answering, but as dead as an unreachable server
                failures[url] = result
            elif isinstance(result, RemoteInferenceError):
                failures[url] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                answers[url] = result
        if self.drop_unreachable_servers and unreachable and len(unreachable) < len(urls):
            for url in unreachable:
                del failures[url]
                self._drop_server(url, action)
        if failures:
            raise ControlPlaneError(action, failures)
        return answers

    def _drop_server(self, url: str, action: str) -> None:
        if url in self.server_urls:
            self.server_urls.remove(url)
            self._world_size = None
            log.warning("dropped unreachable or dead inference server", server=url, during=action)

    async def _control(
        self,
        action: str,
        method: str,
        path: str,
        *,
        params: Any = None,
        json: Any = None,
        per_server_json: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        payloads = dict(zip(self.server_urls, per_server_json, strict=True)) if per_server_json else {}

        async def call(url: str) -> Any:
            body = payloads.get(url, json)
            return await self._request(
                method, f"{url}{path}", params=params, json=body, timeout_s=self.control_timeout_s
            )

        return await self._fan_out(action, call)

    # ------------------------------------------------------------------ data plane

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate through ``/inference/v1/generate`` (token ids in and out).

        Waits (polling) while the servers are paused, like in-process engines. Per-token policy versions are
        the server's (``policy_versions``, or vLLM's ``weight_versions``) when it reports them, else this
        client's ``policy_version``.

        Raises:
            RemoteEngineDeadError: the server's engine died (every server's, behind a router); raised at once.
            RemoteInferenceError: the server rejected the request (4xx, with its message), or it failed after
                the bounded connection retries, or ``request_timeout_s`` passed.
        """
        sampling = {**sampling_fields(request.sampling), "detokenize": False}
        # The version this request starts on (with a LoRA adapter: the one its ``model`` names).
        version = self.policy_version
        payload = {"token_ids": request.prompt_token_ids, "sampling_params": sampling, **self._ids(request)}
        body = await self._data_call(
            "POST", "/inference/v1/generate", json=payload, session_id=request.session_id
        )
        return parse_generate(body, request, f"{self.data_url}/inference/v1/generate", version)

    def serve_adapter(self, name: str | None, policy_version: int) -> None:
        """Requests started from now on name LoRA adapter ``name`` as their ``model`` (None: ``model``) and
        their tokens carry ``policy_version`` where the server reports no versions; set together, with no
        await between, so a request's adapter and version always agree."""
        self.adapter = name
        self.policy_version = policy_version

    def _ids(self, request: GenerateRequest) -> dict[str, Any]:
        """The request's id, session and the served model name, where set."""
        ids: dict[str, Any] = {}
        if request.request_id:
            ids["request_id"] = request.request_id
        model = self.adapter or self.model
        if model is not None:
            ids["model"] = model
        if request.session_id:
            ids["session_id"] = request.session_id
        return ids

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Generate through ``/v1/completions`` with ``stream: true`` (token ids in, ``return_token_ids``
        out), yielding the tokens as the server sends them; see ``InferenceClient.generate_stream``.

        Sampling, logprobs and per-token policy versions are those of ``generate``, so the assembled chunks
        (``collect_stream``) equal its output. Before the stream starts it waits while servers are paused
        (503) and retries connection errors, like ``generate``; once it started, a failure is raised.
        Leaving the iteration early closes the connection, which aborts the request on the server.

        Raises:
            RemoteInferenceError: as ``generate``; also a stream that breaks off or reports an error.
        """
        version = self.policy_version  # as generate's
        payload = {
            "prompt": request.prompt_token_ids,
            **sampling_fields(request.sampling),
            "return_token_ids": True,
            "stream": True,
            **self._ids(request),
        }
        url = f"{self.data_url}/v1/completions"
        response = await self._open_stream(url, payload, request.session_id)
        prompt_len = len(request.prompt_token_ids)
        finished = False
        try:
            async for event in iter_sse(response.content.iter_any()):
                chunk = parse_stream_event(event, url, request, prompt_len, version)
                finished = chunk.finish_reason is not None
                yield chunk
                if finished:
                    return
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise RemoteUnavailableError(f"POST {url}: the stream broke off: {error!r}", url=url) from error
        finally:
            if not finished:  # closing the connection aborts the request on the server
                response.close()
            response.release()
        raise RemoteUnavailableError(f"POST {url}: the stream ended without a finish reason", url=url)

    async def _open_stream(
        self, url: str, payload: dict[str, Any], session_id: str | None
    ) -> aiohttp.ClientResponse:
        """POST ``payload`` and return the response once it is a 200 (retrying like ``_data_call``)."""
        session = self._get_session()
        headers = {"X-Session-ID": session_id} if session_id else None
        retry = DataRetry("POST", url, self.request_timeout_s, self.connect_retries)
        while True:
            remaining = retry.remaining()
            try:
                response = await session.post(
                    url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=remaining)
                )
            except TimeoutError:
                continue  # remaining() raises once the deadline has passed
            except aiohttp.ClientConnectionError as error:
                await retry.after_connection_error(error)
                continue
            except aiohttp.ClientError as error:
                raise RemoteUnavailableError(f"POST {url} failed: {error!r}", url=url) from error
            if response.status < 400:
                return response
            async with response:
                raw = await response.read()
            try:
                body = msgspec.json.decode(raw) if raw else None
            except msgspec.DecodeError:
                body = None
            message = error_message(body, raw.decode(errors="replace"))
            error = http_error(
                f"POST {url} returned HTTP {response.status}: {message}", url, response.status, body
            )
            if response.status != 503 or not isinstance(error, RemoteUnavailableError):
                raise error
            await retry.while_paused()

    async def chat_completion(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/chat/completions`` with ``body`` as given; a ``session_id`` in it also goes in the
        ``X-Session-ID`` header. Returns the server's JSON.

        Raises:
            RemoteInferenceError: as ``generate``.
        """
        return await self._data_call(
            "POST", "/v1/chat/completions", json=dict(body), session_id=body.get("session_id")
        )

    async def completion(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` pass-through (see ``chat_completion``).

        Raises:
            RemoteInferenceError: as ``generate``.
        """
        return await self._data_call(
            "POST", "/v1/completions", json=dict(body), session_id=body.get("session_id")
        )

    async def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt`` by the server's tokenizer (``POST /tokenize``).

        Raises:
            RemoteInferenceError: as ``generate``.
        """
        body = await self._data_call(
            "POST", "/tokenize", json={"prompt": prompt, "add_special_tokens": add_special_tokens}
        )
        return list(body["tokens"])

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` by the server's tokenizer (``POST /detokenize``).

        Raises:
            RemoteInferenceError: as ``generate``.
        """
        body = await self._data_call("POST", "/detokenize", json={"tokens": list(token_ids)})
        return str(body["prompt"])

    async def finish_session(self, session_id: str | None) -> None:
        """Tell the router that ``session_id`` is done, so it can forget the session's server.

        Best effort: a failure is logged, never raised (an external proxy may not know the call).
        """
        if not session_id:
            return
        url = f"{self.data_url}/finish_session"
        try:
            await self._request(
                "POST",
                url,
                params={"session_id": session_id},
                timeout_s=min(self.control_timeout_s, 10.0),
            )
        except (RemoteInferenceError, aiohttp.ClientError) as error:
            log.debug("finish_session failed", url=url, session_id=session_id, error=str(error))

    # ------------------------------------------------------------------ control plane (shorthands of ``control``)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """``control.pause``: pause every server (``POST /pause?mode=``).

        Raises:
            ValueError: ``mode`` is not abort, wait or keep.
            ControlPlaneError: naming each server that failed.
        """
        await self.control.pause(mode)

    async def resume(self) -> None:
        """``control.resume``: resume every server (``POST /resume``).

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        await self.control.resume()

    async def is_paused(self) -> bool:
        """True when every server reports ``is_paused``.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        answers = await self._control("is_paused", "GET", "/is_paused")
        return all(bool(body["is_paused"]) for body in answers.values())

    async def is_sleeping(self) -> bool:
        """True when every server reports ``is_sleeping``.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        answers = await self._control("is_sleeping", "GET", "/is_sleeping")
        return all(bool(body["is_sleeping"]) for body in answers.values())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Drop every server's prefix cache (vLLM 0.33 reads the flag from the query string).

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        params = {"reset_running_requests": "true" if reset_running_requests else "false"}
        await self._control("reset_prefix_cache", "POST", "/reset_prefix_cache", params=params)

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Abort ``request_ids`` (all requests when None or empty) on every server; returns how many the
        servers aborted in total.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        answers = await self._control(
            "abort", "POST", "/abort_requests", json={"request_ids": list(request_ids or [])}
        )
        return sum(int((body or {}).get("aborted", 0)) for body in answers.values())

    async def get_world_size(self) -> int:
        """``control.world_size().total_workers``: the inference workers a weight broadcast must reach.

        Raises:
            ControlPlaneError: a server failed, or the servers disagree (the message lists each one's size).
        """
        return (await self.control.world_size()).total_workers

    async def weight_info(self) -> dict[str, Any]:
        """``GET /weight_info`` of every server: ``{url: {"weight_version": …}}``.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        return await self._control("weight_info", "GET", "/weight_info")
