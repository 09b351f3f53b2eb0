"""``Session``: one agent's view of the proxy — its URL token, its trace, and its requests in flight.

A request runs as its own task: render (through the trace actor), sample, parse, commit. Callers wait on
that task without owning it, so a retried request can join the attempt still running, and the task is
cancelled — which aborts the engine request — once nobody waits for it any more (the client went away).
A ``stream`` request samples through the client's ``generate_stream`` and tells its waiters' watchers of each
new token, so the proxy can stream the reply while it is sampled; so does a request with ``stop`` strings,
whose engine request ends as soon as one completes (``rollflow.tito.stops``). A request with ``n > 1`` is
rendered once and sampled ``n`` times; its replies become sibling branches of the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    SERVICE_UNAVAILABLE,
    EngineError,
    RequestError,
    RollflowError,
    TraceSealedError,
)
from rollflow.ids import unique_hex
from rollflow.inference.client import InferenceClient, collect_stream, generate_past_aborts
from rollflow.inference.prompt_limits import OFFLOAD_CHARS, rendered_chars
from rollflow.messages import (
    FinishReason,
    GenerateChunk,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    sampling_error,
)
from rollflow.tito.renderer import ParsedTurn, TITORenderer, normalize_message, normalize_tools
from rollflow.tito.stops import StopMatcher, cut_at_stop
from rollflow.tito.trace import Sampled, Trace, Turn
from rollflow.tito.wire import ChatCompletionRequest, stop_strings

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
    # the run's temperature, top_p and top_k (and no min_p or penalties); a request that asked otherwise is
    # counted (sampling_overridden).
    enforce_sampling: bool = False
    default_top_k: int = -1
    # The engines return MoE routed experts (``inference.return_routed_experts``), which a reply cut early by a
    # stop string would lose.
    return_routed_experts: bool = False


# Request fields that reshape the policy's distribution in ways the engines do not implement, with their
# neutral value: the run's (neutral) values win when sampling is enforced, otherwise they must be neutral.
_UNSAMPLED_FIELDS = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logit_bias": None,
}


@dataclass(slots=True)
class TurnProgress:
    """A turn being sampled, as ``complete``'s ``on_tokens`` watchers see it."""

    # The id the committed turn will have.
    response_id: str = field(default_factory=lambda: f"chatcmpl-{unique_hex()}")
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
        # What a wire format keeps about this session's turns beyond the tree (``rollflow.tito.apis``).
        self.api_state: dict[str, Any] = {}
        self._client = client
        self._renderer = renderer
        self._settings = settings
        self._inflight: dict[str, _InFlight] = {}
        self._tasks: set[asyncio.Task] = set()
        # time.monotonic() of the last request's start or end (the proxy's idle expiry).
        self.last_active = time.monotonic()

    def idle_for_s(self, now: float) -> float:
        """Seconds since the last request started or ended as of ``now`` (``time.monotonic()``); 0 while one
        is in flight."""
        return 0.0 if self._tasks else now - self.last_active

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, turns={len(self.trace.turns)}, closed={self.closed})"

    async def complete(
        self,
        request: ChatCompletionRequest,
        *,
        request_key: str | None = None,
        is_retry: bool = False,
        on_tokens: TokenWatcher | None = None,
        side_call: str | None = None,
    ) -> list[Turn]:
        """Answer one validated request: replay the recorded turns for a retry, else sample new ones (one per
        reply: ``request.n``, default 1).

        ``request_key`` identifies a request across client retries (an ``Idempotency-Key``, or the body
        digest of an SDK-marked retry); ``is_retry`` says this call is such a retry. ``on_tokens`` is called
        (on this loop) as tokens of a ``stream`` request are sampled, with the turn's progress so far.
        ``side_call``: the request is a side call of this kind (``rollflow.tito.side_calls``): its replies are
        recorded as non-trainable branches, and counted.

        Raises:
            TraceSealedError: the session is closed.
            RequestError: the request cannot be served (prompt too long: 400; engine unavailable: 503).
        """
        # The agent reads these messages: they say "this session", never its id (the admin API's handle).
        if self.closed:
            raise TraceSealedError("this session is closed")
        self.last_active = time.monotonic()
        entry = None
        if request_key is not None and is_retry:
            turns = self.trace.replay(request_key)
            if turns is not None:
                return turns
            entry = self._inflight.get(request_key)  # the first attempt is still running: join it
        if entry is None:
            entry = _InFlight()
            task = asyncio.get_running_loop().create_task(self._run(request, request_key, entry, side_call))
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
                raise TraceSealedError("this session was closed during the request") from None
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
            self.last_active = time.monotonic()
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

    async def _run(
        self,
        request: ChatCompletionRequest,
        request_key: str | None,
        entry: _InFlight,
        side_call: str | None = None,
    ) -> list[Turn]:
        sampling = self._sampling(request)
        self._check_sampling(request, sampling)
        messages = [normalize_message(m) for m in request.messages]
        tools = normalize_tools(request.tools)
        renderer, options = self._template(request)
        prepared = await self.trace.prepare(
            messages, tools, renderer=renderer, offload=rendered_chars(messages, tools) > OFFLOAD_CHARS
        )
        try:
            samples = await _all(
                [
                    self._sample(prepared.prompt_ids, request, sampling, entry, index)
                    for index in range(request.n or 1)
                ]
            )
        except RequestError:
            raise
        except EngineError as error:
            if error.http_status >= 500:  # a failure inside the engine, not the request's: as unavailable
                raise self._unavailable(error) from None
            # The request's own fault, local engine or remote server alike: the agent hears the same 4xx.
            if error.code == CONTEXT_LENGTH_EXCEEDED:
                self.trace.stats.context_exceeded += 1
                raise RequestError(
                    f"the prompt does not fit the model's context: {error}",
                    param="messages",
                    code=CONTEXT_LENGTH_EXCEEDED,
                ) from None
            raise RequestError(
                str(error), status=error.http_status, param="messages", code=error.code
            ) from None
        except RollflowError as error:
            raise self._unavailable(error) from None
        choices = []
        for sampled, stop in samples:
            parsed = renderer.parse(sampled.token_ids, tools, prepared.parse_prompt_ids)
            if stop is not None:
                parsed = _cut_reply(parsed, stop, include=bool(request.include_stop_str_in_output))
            message, finish_reason = _assistant_message(parsed, sampled.finish_reason)
            turn_options = options if stop is None else {**options, "stop_reason": stop}
            if side_call is not None:
                turn_options = {**turn_options, "side_call": side_call}
            choices.append((sampled, message, finish_reason, turn_options or None))
        return await self.trace.commit_choices(
            prepared,
            choices,
            response_id=entry.progress.response_id,
            request_key=request_key,
            side_call=side_call,
        )

    def _unavailable(self, error: RollflowError) -> RequestError:
        """A 503 for a failure the agent cannot fix (no server, a dead engine); recorded on the trace, which
        masks the trajectory."""
        self.trace.errors.append(f"{type(error).__name__}: {error}")
        return RequestError(f"inference is unavailable: {error}", status=503, code=SERVICE_UNAVAILABLE)

    def _check_sampling(
        self, request: ChatCompletionRequest, sampling_values: tuple[float, float, int]
    ) -> None:
        """400 naming the field for sampling values the engines cannot honour (what the request samples at,
        after ``enforce_sampling``), before anything is rendered or sent."""
        temperature, top_p, top_k = sampling_values
        max_tokens = request.max_completion_tokens or request.max_tokens or self._settings.default_max_tokens
        problem = sampling_error(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=request.seed
        )
        if problem is not None:
            field, message = problem
            raise RequestError(message, param=field)

    def _template(self, request: ChatCompletionRequest) -> tuple[TITORenderer, dict[str, Any]]:
        """The renderer for this request's ``chat_template_kwargs`` and what of them it applies (recorded with
        the turn). A switch the renderer lacks changes nothing; the proxy counted it (``thinking_switch_unused``)
        or, strict, refused it."""
        kwargs = request.chat_template_kwargs or {}
        if "enable_thinking" not in kwargs:
            return self._renderer, {}
        variant = self._renderer.variant(enable_thinking=kwargs["enable_thinking"])
        if variant is None:  # no thinking switch: the template ignores the key, as vLLM's does (counted)
            return self._renderer, {}
        return variant, {"chat_template_kwargs": {"enable_thinking": kwargs["enable_thinking"]}}

    def _sampling(self, request: ChatCompletionRequest) -> tuple[float, float, int]:
        """The temperature, top_p and top_k a request samples at: its own, or the defaults when it gives none
        or when ``enforce_sampling`` is on (then a request that asked for others is counted).

        Raises:
            RequestError: sampling is not enforced and the request asks for what the engines do not implement
                (``min_p``, ``repetition_penalty``, penalties, ``logit_bias``).
        """
        settings = self._settings
        defaults = (settings.default_temperature, settings.default_top_p, _top_k(settings.default_top_k))
        asked = (request.temperature, request.top_p, None if request.top_k is None else _top_k(request.top_k))
        unsampled = [
            name
            for name, neutral in _UNSAMPLED_FIELDS.items()
            if getattr(request, name) not in (None, neutral) and getattr(request, name) != {}
        ]
        if settings.enforce_sampling:
            if unsampled or any(
                value is not None and value != default for value, default in zip(asked, defaults, strict=True)
            ):
                self.trace.stats.sampling_overridden += 1
            return defaults
        if unsampled:
            name = unsampled[0]
            raise RequestError(
                f"{name}: the inference engines do not implement it, and it would change the policy's "
                "distribution; leave it unset (or enable agent.enforce_sampling to sample every request at "
                "the run's settings)",
                param=name,
                code="unsupported_value",
            )
        temperature, top_p, top_k = (
            default if value is None else value for value, default in zip(asked, defaults, strict=True)
        )
        return temperature, top_p, top_k

    async def _sample(
        self,
        prompt_ids: list[int],
        request: ChatCompletionRequest,
        sampling_values: tuple[float, float, int],
        entry: _InFlight,
        index: int,
    ) -> tuple[Sampled, str | None]:
        """One reply (``index`` of ``request.n``) at ``sampling_values`` (temperature, top_p, top_k) and the
        stop string that ended it, if one did."""
        settings = self._settings
        max_tokens = request.max_completion_tokens or request.max_tokens or settings.default_max_tokens
        temperature, top_p, top_k = sampling_values
        stops = stop_strings(request)
        matcher = StopMatcher(stops, self._renderer.decode) if stops else None
        # With stop strings the engine request streams, so it ends as soon as one completes; except when routed
        # experts are wanted, which come whole at the end: then the reply is cut after it is sampled.
        streamed = bool(request.stream) or (
            matcher is not None
            and not settings.return_routed_experts
            and hasattr(self._client, "generate_stream")
        )
        seed = None if request.seed is None else request.seed + index

        async def attempt(so_far: GenerateOutput | None, aborts: int) -> GenerateOutput:
            tokens = so_far.token_ids if so_far is not None else []
            logprobs = so_far.logprobs if so_far is not None else []
            sampling = SamplingParams(
                max_tokens=max_tokens - len(tokens),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop_token_ids=self._renderer.stop_token_ids,
            )
            generate_request = GenerateRequest(
                prompt_token_ids=prompt_ids + tokens,
                sampling=sampling,
                request_id=f"{self.session_id}-{unique_hex()}",
                session_id=self.session_id,
            )
            if streamed:
                watchers = entry if index == 0 else _InFlight()
                return await self._generate_streamed(
                    generate_request, prompt_ids, tokens, logprobs, watchers, matcher
                )
            output = await self._client.generate(generate_request)
            if matcher is not None:
                _cut_output(output, matcher.feed(output.token_ids), len(generate_request.prompt_token_ids))
            return output

        # An abort (weights being updated) keeps its partial tokens; the reply continues from them.
        output, _ = await generate_past_aborts(
            attempt, max_tokens=max_tokens, max_aborts=settings.max_abort_resubmits
        )
        stop = matcher.matched if matcher is not None else None
        sampled = Sampled(
            output.token_ids,
            output.logprobs,
            output.policy_versions,
            output.finish_reason.value,
            output.routed_experts,
            output.kept_counts,
        )
        return sampled, stop

    async def _generate_streamed(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        tokens: list[int],
        logprobs: list[float],
        entry: _InFlight,
        matcher: StopMatcher | None = None,
    ) -> GenerateOutput:
        """``generate`` through the client's stream, telling ``entry``'s watchers of each new token (after
        ``tokens``, the turn's tokens of earlier, aborted attempts); once ``matcher`` sees a stop string
        complete, the rest is dropped and the engine request ended. A client without ``generate_stream``
        answers whole; its watchers hear of the tokens once, at the end."""
        stream = getattr(self._client, "generate_stream", None)
        if stream is None:
            output = await self._client.generate(request)
            if matcher is not None:
                _cut_output(output, matcher.feed(output.token_ids), len(request.prompt_token_ids))
            entry.notify(prompt_ids, tokens + output.token_ids, logprobs + output.logprobs)
            return output

        def stop_at(chunk: GenerateChunk) -> int | None:
            return matcher.feed(chunk.token_ids) if matcher is not None else None

        def on_tokens(new_tokens: list[int], new_logprobs: list[float]) -> None:
            entry.notify(prompt_ids, tokens + new_tokens, logprobs + new_logprobs)

        # Leaving the stream early (a stop string) closes it, which ends the engine request.
        async with contextlib.aclosing(stream(request)) as chunks:
            return await collect_stream(chunks, stop_at=stop_at, on_tokens=on_tokens)


async def _all(coroutines: list[Any]) -> list[Any]:
    """Run ``coroutines`` concurrently; the first failure cancels the others and is raised."""
    if len(coroutines) == 1:
        return [await coroutines[0]]
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _top_k(value: int) -> int:
    """vLLM's 0 and -1 both disable top-k; one spelling, so that they compare equal."""
    return -1 if value <= 0 else value


def _cut_output(output: GenerateOutput, keep: int | None, prompt_len: int) -> None:
    """Drop, in place, what was sampled after the token that completed a stop string."""
    if keep is None:
        return
    output.token_ids = output.token_ids[:keep]
    output.logprobs = output.logprobs[:keep]
    output.policy_versions = output.policy_versions[:keep]
    if output.kept_counts is not None:
        output.kept_counts = output.kept_counts[:keep]
    output.finish_reason = FinishReason.STOP
    if output.routed_experts is not None:  # rows of the tokens run: the prompt and all but the last kept
        output.routed_experts = output.routed_experts[: prompt_len + keep - 1]


def _cut_reply(parsed: ParsedTurn, stop: str, *, include: bool) -> ParsedTurn:
    """The parsed reply's text ending before the stop string (or after it, ``include``), as vLLM cuts its
    output text; reasoning is cut instead when the stop string completed there."""
    content, found = cut_at_stop(parsed.content, stop, include=include)
    if found:
        return ParsedTurn(
            content.strip() if not include else content, parsed.reasoning_content, parsed.tool_calls
        )
    if parsed.reasoning_content:
        reasoning, found = cut_at_stop(parsed.reasoning_content, stop, include=include)
        if found:
            return ParsedTurn(parsed.content, reasoning or None, parsed.tool_calls)
    return parsed


def _assistant_message(parsed: ParsedTurn, engine_finish: str) -> tuple[dict[str, Any], str]:
    """The assistant message exactly as ``normalize_message`` reads it back when the client resends it."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{unique_hex()}",
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
