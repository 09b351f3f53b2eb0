"""``Session``: one agent's view of the proxy — its URL token, its trace, and its requests in flight.

A request runs as its own task: render (through the trace actor), sample, parse, commit. Callers wait on
that task without owning it, so a retried request can join the attempt still running, and the task is
cancelled — which aborts the engine request — once nobody waits for it any more (the client went away).
A ``stream`` request samples through the client's ``generate_stream`` and tells its waiters' watchers of each
new token, so the proxy can stream the reply while it is sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollflow.errors import EngineError, RollflowError
from rollflow.inference.client import InferenceClient
from rollflow.inference.prompt_limits import OFFLOAD_CHARS, message_text_chars
from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest, SamplingParams, sampling_error
from rollflow.tito.renderer import ParsedTurn, TITORenderer, normalize_message, normalize_tools
from rollflow.tito.trace import Sampled, Trace, TraceSealedError, Turn
from rollflow.tito.wire import ChatCompletionRequest, RequestError

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """What the proxy applies to every request of its sessions."""

    model_name: str
    # max_tokens when the request gives none; the engine also stops at its context length.
    default_max_tokens: int = 1024
    default_temperature: float = 1.0
    # Engine aborts (a pause for a weight update) are continued from the partial tokens this many times.
    max_abort_resubmits: int = 8
    default_top_p: float = 1.0
    # Training: sample every request at the defaults whatever it asks, since the trainer's PPO ratio assumes
    # the run's temperature and top_p; a request that asked otherwise is counted (sampling_overridden).
    enforce_sampling: bool = False


@dataclass(slots=True)
class TurnProgress:
    """A turn being sampled, as ``complete``'s ``on_tokens`` watchers see it."""

    # The id the committed turn will have.
    response_id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    prompt_ids: list[int] = field(default_factory=list)
    # Completion tokens sampled so far and their logprobs.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


TokenWatcher = Callable[[TurnProgress], None]


@dataclass(eq=False, slots=True)
class _InFlight:
    task: asyncio.Task | None = None
    waiters: int = 0
    progress: TurnProgress = field(default_factory=TurnProgress)
    watchers: list[TokenWatcher] = field(default_factory=list)

    def notify(self, prompt_ids: list[int], token_ids: list[int], logprobs: list[float]) -> None:
        progress = self.progress
        progress.prompt_ids, progress.token_ids, progress.logprobs = prompt_ids, token_ids, logprobs
        for watcher in list(self.watchers):
            watcher(progress)


class Session:
    """One agent session. Create through ``TITOProxy.open_session``; ``base_url`` is what the agent uses."""

    def __init__(
        self,
        session_id: str,
        token: str,
        base_url: str,
        client: InferenceClient,
        renderer: TITORenderer,
        settings: TurnSettings,
    ):
        self.session_id = session_id
        self.token = token
        self.base_url = base_url
        self.trace = Trace(renderer, session_id)
        self.closed = False
        # Set by the proxy's close_session while it drains; done once the trace is sealed.
        self.close_done: asyncio.Future[None] | None = None
        # Body digest of each Idempotency-Key used, so a key reused with another body is refused.
        self.key_digests: dict[str, bytes] = {}
        self._client = client
        self._renderer = renderer
        self._settings = settings
        self._inflight: dict[str, _InFlight] = {}
        self._tasks: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, turns={len(self.trace.turns)}, closed={self.closed})"

    async def complete(
        self,
        request: ChatCompletionRequest,
        *,
        request_key: str | None = None,
        is_retry: bool = False,
        on_tokens: TokenWatcher | None = None,
    ) -> Turn:
        """Answer one validated request: replay a recorded turn for a retry, else sample a new one.

        ``request_key`` identifies a request across client retries (an ``Idempotency-Key``, or the body
        digest of an SDK-marked retry); ``is_retry`` says this call is such a retry. ``on_tokens`` is called
        (on this loop) as tokens of a ``stream`` request are sampled, with the turn's progress so far.

        Raises:
            TraceSealedError: the session is closed.
            RequestError: the request cannot be served (prompt too long: 400; engine unavailable: 503).
        """
        if self.closed:
            raise TraceSealedError(f"session {self.session_id!r} is closed")
        entry = None
        if request_key is not None and is_retry:
            turn = self.trace.replay(request_key)
            if turn is not None:
                return turn
            entry = self._inflight.get(request_key)  # the first attempt is still running: join it
        if entry is None:
            entry = _InFlight()
            task = asyncio.get_running_loop().create_task(self._run(request, request_key, entry))
            entry.task = task
            self._tasks.add(task)
            task.add_done_callback(self._forget(request_key, entry))
            if request_key is not None:
                self._inflight[request_key] = entry
        entry.waiters += 1
        if on_tokens is not None:
            entry.watchers.append(on_tokens)
            if entry.progress.token_ids:  # joined a streamed attempt in flight: catch up
                on_tokens(entry.progress)
        try:
            return await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if entry.task.cancelled() and current is not None and not current.cancelling():
                # The turn was cancelled by close_session, not this caller: answer instead of vanishing.
                raise TraceSealedError(f"session {self.session_id!r} was closed during the request") from None
            raise
        finally:
            entry.waiters -= 1
            if on_tokens is not None:
                entry.watchers.remove(on_tokens)
            if entry.waiters == 0 and not entry.task.done():
                entry.task.cancel()  # nobody waits any more: abort the engine request

    def _forget(self, request_key: str | None, entry: _InFlight):
        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if request_key is not None and self._inflight.get(request_key) is entry:
                del self._inflight[request_key]
            if not task.cancelled():
                task.exception()  # retrieved here so an unawaited failure is not reported as lost

        return done

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for requests in flight, then cancel the rest and wait for them."""
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    # ------------------------------------------------------------------ one turn

    async def _run(self, request: ChatCompletionRequest, request_key: str | None, entry: _InFlight) -> Turn:
        self._check_sampling(request)
        messages = [normalize_message(m) for m in request.messages]
        tools = normalize_tools(request.tools)
        prepared = await self.trace.prepare(
            messages, tools, offload=message_text_chars(messages) > OFFLOAD_CHARS
        )
        try:
            sampled = await self._sample(prepared.prompt_ids, request, entry)
        except RequestError:
            raise
        except EngineError as error:
            if "max_model_len" in str(error):
                self.trace.stats.context_exceeded += 1
                raise RequestError(
                    f"the prompt does not fit the model's context: {error}",
                    param="messages",
                    code="context_length_exceeded",
                ) from None
            raise RequestError(str(error), param="messages") from None
        except RollflowError as error:
            self.trace.errors.append(f"{type(error).__name__}: {error}")
            raise RequestError(
                f"inference is unavailable: {error}", status=503, type="service_unavailable"
            ) from None
        parsed = self._renderer.parse(sampled.token_ids, tools, prepared.parse_prompt_ids)
        message, finish_reason = _assistant_message(parsed, sampled.finish_reason)
        return await self.trace.commit(
            prepared,
            sampled,
            message,
            finish_reason=finish_reason,
            response_id=entry.progress.response_id,
            request_key=request_key,
        )

    def _check_sampling(self, request: ChatCompletionRequest) -> None:
        """400 naming the field for sampling values the engines cannot honour (what the request would sample
        at, after ``enforce_sampling``), before anything is rendered or sent."""
        temperature, top_p = self._sampling(request, count=False)
        max_tokens = request.max_completion_tokens or request.max_tokens or self._settings.default_max_tokens
        problem = sampling_error(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=-1, seed=request.seed
        )
        if problem is not None:
            field, message = problem
            raise RequestError(message, param=field)

    def _sampling(self, request: ChatCompletionRequest, *, count: bool = True) -> tuple[float, float]:
        """The temperature and top_p a request samples at: its own, or the defaults when it gives none or
        when ``enforce_sampling`` is on (then a request that asked for others is counted)."""
        settings = self._settings
        defaults = (settings.default_temperature, settings.default_top_p)
        asked = (request.temperature, request.top_p)
        if settings.enforce_sampling:
            if (
                any(
                    value is not None and value != default
                    for value, default in zip(asked, defaults, strict=True)
                )
                and count
            ):
                self.trace.stats.sampling_overridden += 1
            return defaults
        return (
            defaults[0] if asked[0] is None else asked[0],
            defaults[1] if asked[1] is None else asked[1],
        )

    async def _sample(
        self, prompt_ids: list[int], request: ChatCompletionRequest, entry: _InFlight
    ) -> Sampled:
        settings = self._settings
        max_tokens = request.max_completion_tokens or request.max_tokens or settings.default_max_tokens
        temperature, top_p = self._sampling(request)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routed_experts = None
        for _ in range(settings.max_abort_resubmits + 1):
            sampling = SamplingParams(
                max_tokens=max_tokens - len(tokens),
                temperature=temperature,
                top_p=top_p,
                seed=request.seed,
                stop_token_ids=self._renderer.stop_token_ids,
            )
            generate_request = GenerateRequest(
                prompt_token_ids=prompt_ids + tokens,
                sampling=sampling,
                request_id=f"{self.session_id}-{secrets.token_hex(4)}",
                session_id=self.session_id,
            )
            if request.stream:
                output = await self._generate_streamed(generate_request, prompt_ids, tokens, logprobs, entry)
            else:
                output = await self._client.generate(generate_request)
            tokens += output.token_ids
            logprobs += output.logprobs
            versions += output.policy_versions
            routed_experts = getattr(output, "routed_experts", None)
            finish = output.finish_reason
            # An abort (weights being updated) keeps its partial tokens; continue from them.
            if finish != FinishReason.ABORT or len(tokens) >= max_tokens:
                break
        if finish == FinishReason.ABORT and len(tokens) >= max_tokens:
            finish = FinishReason.LENGTH
        return Sampled(tokens, logprobs, versions, finish.value, routed_experts)

    async def _generate_streamed(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        tokens: list[int],
        logprobs: list[float],
        entry: _InFlight,
    ) -> GenerateOutput:
        """``generate`` through the client's stream, telling ``entry``'s watchers of each new token (after
        ``tokens``, the turn's tokens of earlier, aborted attempts). A client without ``generate_stream``
        answers whole; its watchers hear of the tokens once, at the end."""
        stream = getattr(self._client, "generate_stream", None)
        if stream is None:
            output = await self._client.generate(request)
            entry.notify(prompt_ids, tokens + output.token_ids, logprobs + output.logprobs)
            return output
        new_tokens: list[int] = []
        new_logprobs: list[float] = []
        versions: list[int] = []
        async with contextlib.aclosing(stream(request)) as chunks:
            async for chunk in chunks:
                new_tokens += chunk.token_ids
                new_logprobs += chunk.logprobs
                versions += chunk.policy_versions
                if chunk.token_ids:
                    entry.notify(prompt_ids, tokens + new_tokens, logprobs + new_logprobs)
                if chunk.finish_reason is not None:
                    return GenerateOutput(
                        chunk.request_id,
                        new_tokens,
                        new_logprobs,
                        chunk.finish_reason,
                        versions,
                        chunk.prompt_len,
                        chunk.routed_experts,
                    )
        raise RollflowError("the generation stream ended without a finish reason")


def _assistant_message(parsed: ParsedTurn, engine_finish: str) -> tuple[dict[str, Any], str]:
    """The assistant message exactly as ``normalize_message`` reads it back when the client resends it."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in parsed.tool_calls
        ]
    if parsed.reasoning_content:
        message["reasoning_content"] = parsed.reasoning_content
    if engine_finish == "length":
        finish_reason = "length"
    elif parsed.tool_calls:
        finish_reason = "tool_calls"
    else:
        finish_reason = "stop"
    return message, finish_reason


def arguments_text(arguments: Any) -> str:
    """Tool-call arguments as the JSON string the API returns."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
