"""``stream: true`` on ``/v1/completions`` and ``/v1/chat/completions``: SSE chunks as vLLM sends them.

Each (prompt, sample) job runs as one engine stream (``TorchEngine.generate_stream``) in its own task; the
tasks feed one queue, so chunks of all choices go out as they are sampled, each tagged with its ``index``.
The first chunk is awaited before the response starts, so a request the engine refuses is still a 4xx JSON
error; an error after that is sent as an SSE ``{"error": …}`` event before ``[DONE]``. A client that
disconnects cancels the handler, which cancels the tasks, which aborts their engine requests.

Chunk shapes follow vLLM: completions chunks carry ``text`` (and, with ``return_token_ids``, ``token_ids``
per chunk and ``prompt_token_ids`` in each choice's first chunk); chat chunks carry a ``delta`` (the role
first, then ``content`` and ``reasoning_content``; tool calls in the choice's last chunk, since the renderer
parses them from the whole reply), ``token_ids`` per chunk and ``prompt_token_ids`` in the first chunk.
Every choice chunk also carries ``policy_versions`` of its tokens (and ``kept_counts`` when a token was cut). With ``stream_options.include_usage`` a
last chunk with no choices carries the usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from rollflow.errors import EngineDeadError, EngineError
from rollflow.http.sse import SSE_DONE, sse_event
from rollflow.inference.engine.server_protocol import (
    ApiError,
    StreamOptions,
    bad_request,
    engine_dead,
    engine_error,
)
from rollflow.inference.routed_experts import pack_routed_experts
from rollflow.inference.text_deltas import IncrementalDecoder, TextDeltas
from rollflow.messages import FinishReason, GenerateChunk, GenerateOutput, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from rollflow.inference.engine.server_routes import DataPlane

log = structlog.get_logger(__name__)

Job = tuple[list[int], SamplingParams]
# A streamed chat reply is parsed again at most after this many times the last parse's duration.
PARSE_BACKOFF = 4.0


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    """400 for ``stream_options`` without ``stream`` (as vLLM)."""
    if options is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")


@dataclass(slots=True)
class _Choice:
    """What one streamed choice has produced so far."""

    index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    started: bool = False
    # Completions text (set by the handler, which knows skip_special_tokens).
    text: IncrementalDecoder | None = None
    reasoning: TextDeltas = field(default_factory=lambda: TextDeltas(strip=True))
    # Chat content: parsers strip the reply, so trailing whitespace waits for more text.
    content: TextDeltas = field(default_factory=lambda: TextDeltas(strip=True))
    logprob_offset: int = 0
    # Policy versions of tokens whose chunk was held back (no stable text yet), sent with the next one.
    pending_versions: list[int] = field(default_factory=list)
    # Their kept counts (0: nothing cut), likewise.
    pending_kept_counts: list[int] = field(default_factory=list)
    # Chat: when the reply may be parsed again (perf_counter seconds).
    next_parse_at: float = 0.0

    def output(self, finish_reason: FinishReason) -> GenerateOutput:
        return GenerateOutput("", self.token_ids, [], finish_reason, [])


async def _engine_chunks(
    plane: DataPlane, request_id: str, jobs: list[Job], session_id: str | None
) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """``(choice index, chunk)`` of every job's engine stream, as they arrive, until all have finished.

    Raises:
        ApiError: 400 for a request the engine refuses, 503 when the engine is not running.
    """
    plane.server.check_accepting()
    requests = [
        GenerateRequest(prompt, params, request_id=request_id, session_id=session_id)
        for prompt, params in jobs
    ]
    if len(requests) == 1:  # the common case: no task and no second queue between engine and response
        try:
            async with contextlib.aclosing(plane.engine.generate_stream(requests[0])) as stream:
                async for chunk in stream:
                    yield 0, chunk
        except EngineError as error:
            raise engine_error(error) from None
        except EngineDeadError as error:
            raise engine_dead(error) from None
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(plane.engine.generate_stream(request)) as stream:
                async for chunk in stream:
                    queue.put_nowait((index, chunk, None))
        except (EngineError, EngineDeadError) as error:
            queue.put_nowait((index, None, error))

    tasks = [asyncio.create_task(pump(index, request)) for index, request in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if isinstance(error, EngineError):
                raise engine_error(error)
            if error is not None:
                raise engine_dead(error)
            if chunk.finish_reason is not None:
                running -= 1
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_response(
    request: web.Request,
    chunks: AsyncIterator[tuple[int, GenerateChunk]],
    events: Callable[[int, GenerateChunk], list[bytes]],
    opening: Callable[[], list[bytes]],
    closing: Callable[[], list[bytes]],
) -> web.StreamResponse:
    """Answer with SSE: ``opening()``, then ``events(index, chunk)`` per engine chunk, ``closing()``, [DONE].

    The first engine chunk is awaited before the response starts, so that its errors are still 4xx JSON.
    """
    async with contextlib.aclosing(chunks):
        try:
            first = await anext(chunks)
        except StopAsyncIteration:  # no jobs: cannot happen (n >= 1, one prompt at least)
            raise bad_request("nothing to generate") from None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            parts = opening() + events(*first)
            await response.write(b"".join(parts))
            async for index, chunk in chunks:
                # One write per engine chunk: each token reaches the client as soon as it is sampled.
                parts = events(index, chunk)
                if parts:
                    await response.write(b"".join(parts))
            await response.write(b"".join(closing()))
        except ApiError as error:  # the stream had started: say so in the stream
            log.warning("stream ended by an error", status=error.status, error=error.message)
            await response.write(b"data: " + error.body() + b"\n\n")
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def stream_completions(
    plane: DataPlane,
    request: web.Request,
    body: Any,
    request_id: str,
    jobs: list[Job],
    user_stop_ids: list[int],
    session_id: str | None,
    prompt_tokens: int,
) -> web.StreamResponse:
    """SSE for ``/v1/completions`` (``body`` is the decoded ``CompletionBody``)."""
    created, model = int(time.time()), plane.server.served_model_name
    skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
    options = body.stream_options or StreamOptions()
    choices = [_Choice(index, prompt) for index, (prompt, _) in enumerate(jobs)]
    for choice in choices:
        choice.text = IncrementalDecoder(lambda ids: plane._decode(ids, skip_special))

    def usage() -> dict[str, int]:
        return _usage(prompt_tokens, sum(len(c.token_ids) for c in choices))

    def envelope(choice_list: list[dict[str, Any]], with_usage: bool) -> bytes:
        return sse_event(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choice_list,
                "usage": usage() if with_usage else None,
            }
        )

    def events(index: int, chunk: GenerateChunk) -> list[bytes]:
        state = choices[index]
        state.token_ids += chunk.token_ids
        final = chunk.finish_reason is not None
        text = state.text.finish(state.token_ids) if final else state.text.update(state.token_ids)
        if final and state.text.diverged:
            log.warning("streamed text differs from the decoded completion", request_id=request_id)
        out: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": chunk.finish_reason.value if final else None,
            "stop_reason": plane._stop_reason(state.output(chunk.finish_reason), user_stop_ids)
            if final
            else None,
            "policy_versions": chunk.policy_versions,
        }
        if chunk.kept_counts is not None:
            out["kept_counts"] = chunk.kept_counts
        if body.logprobs is not None:
            logprobs = plane._completion_logprobs(chunk, bool(body.return_tokens_as_token_ids))
            logprobs["text_offset"] = [state.logprob_offset + o for o in logprobs["text_offset"]]
            state.logprob_offset += sum(len(t) for t in logprobs["tokens"])
            out["logprobs"] = logprobs
        if body.return_token_ids:
            out["token_ids"] = chunk.token_ids
            if not state.started:
                out["prompt_token_ids"] = state.prompt
        if chunk.routed_experts is not None:  # the last chunk: the whole request's routes
            out["routed_experts"] = pack_routed_experts(chunk.routed_experts)
        state.started = True
        return [envelope([out], bool(options.continuous_usage_stats))]

    def closing() -> list[bytes]:
        return [envelope([], True)] if options.include_usage else []

    chunks = _engine_chunks(plane, request_id, jobs, session_id)
    return await stream_response(request, chunks, events, list, closing)


async def stream_chat(
    plane: DataPlane,
    request: web.Request,
    body: Any,
    request_id: str,
    prompt: list[int],
    jobs: list[Job],
    user_stop_ids: list[int],
    session_id: str | None,
) -> web.StreamResponse:
    """SSE for ``/v1/chat/completions`` (``body`` is the decoded ``ChatBody``)."""
    created, model = int(time.time()), plane.server.served_model_name
    renderer = plane.server.renderer
    options = body.stream_options or StreamOptions()
    choices = [_Choice(index, prompt) for index in range(len(jobs))]

    def envelope(choice_list: list[dict[str, Any]], with_usage: bool, **extra: Any) -> bytes:
        return sse_event(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choice_list,
                "usage": _usage(len(prompt), sum(len(c.token_ids) for c in choices)) if with_usage else None,
                **extra,
            }
        )

    def opening() -> list[bytes]:
        role = [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in choices
        ]
        extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
        return [envelope(role, False, **extra)]

    def events(index: int, chunk: GenerateChunk) -> list[bytes]:
        state = choices[index]
        state.token_ids += chunk.token_ids
        delta: dict[str, Any] = {}
        out: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if chunk.finish_reason is None and time.perf_counter() >= state.next_parse_at:
            started = time.perf_counter()
            try:
                parsed = renderer.parse_response(state.token_ids, tools=body.tools, prompt_ids=prompt)
            except Exception:  # a reply cut mid-structure may not parse yet: wait for more tokens
                parsed = None
            # Each parse reads the whole reply so far: the next waits PARSE_BACKOFF times as long as this one
            # took, which keeps parsing to a small share of the time however long the reply grows.
            finished = time.perf_counter()
            state.next_parse_at = finished + PARSE_BACKOFF * (finished - started)
            if parsed is not None:
                if reasoning := state.reasoning.update(parsed.reasoning_content or ""):
                    delta["reasoning_content"] = reasoning
                if content := state.content.update(parsed.content or ""):
                    delta["content"] = content
        elif chunk.finish_reason is not None:
            output = state.output(chunk.finish_reason)
            message = plane._message(prompt, output, body.tools)
            if reasoning := state.reasoning.update(message.get("reasoning_content") or "", final=True):
                delta["reasoning_content"] = reasoning
            if content := state.content.update(message.get("content") or "", final=True):
                delta["content"] = content
            if state.content.diverged or state.reasoning.diverged:
                log.warning("streamed chat text differs from the parsed reply", request_id=request_id)
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            finish = chunk.finish_reason.value
            if message.get("tool_calls") and chunk.finish_reason is FinishReason.STOP:
                finish = "tool_calls"
            out["finish_reason"] = finish
            out["stop_reason"] = plane._stop_reason(output, user_stop_ids)
            if chunk.routed_experts is not None:
                out["routed_experts"] = pack_routed_experts(chunk.routed_experts)
        if body.logprobs:
            out["logprobs"] = {"content": plane._chat_logprobs(chunk)}
        if body.return_token_ids:
            out["token_ids"] = chunk.token_ids
        state.pending_versions += chunk.policy_versions
        state.pending_kept_counts += chunk.kept_counts or [0] * len(chunk.token_ids)
        if not delta and chunk.finish_reason is None and not body.logprobs and not body.return_token_ids:
            return []  # nothing to show yet (text held back until stable)
        out["policy_versions"], state.pending_versions = state.pending_versions, []
        if any(state.pending_kept_counts):
            out["kept_counts"] = state.pending_kept_counts
        state.pending_kept_counts = []
        return [envelope([out], bool(options.continuous_usage_stats))]

    def closing() -> list[bytes]:
        return [envelope([], True)] if options.include_usage else []

    chunks = _engine_chunks(plane, request_id, jobs, session_id)
    return await stream_response(request, chunks, events, opening, closing)
