"""A turn streamed while it is sampled, for any of the wire formats the proxy speaks.

``stream_turn`` runs the turn and hands its progress to a ``TurnWriter``, which turns it into the events of
one API (Chat Completions chunks, Responses events, Anthropic Messages events). ``StreamedText`` is what
every writer shares: the reply's reasoning and text, parsed whole from the tokens so far, sent once stable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from rollflow.errors import RequestError, RollflowError, TraceSealedError
from rollflow.inference.text_deltas import TextDeltas
from rollflow.tito.renderer import TITORenderer, normalize_tools
from rollflow.tito.session import Session, TurnProgress
from rollflow.tito.stops import hold_back
from rollflow.tito.trace import Turn
from rollflow.tito.wire import ChatCompletionRequest, stop_strings

# A streamed reply is parsed again at most after this many times the last parse's duration.
PARSE_BACKOFF = 4.0


class TurnWriter(Protocol):
    """The events of one streamed turn in one API's wire format."""

    async def start(self, request: web.Request) -> web.StreamResponse:
        """Send the headers and the opening events."""
        ...

    async def progress(self, response: web.StreamResponse, progress: TurnProgress) -> None:
        """Send what the tokens sampled so far add (nothing while it is not stable)."""
        ...

    async def finish(self, response: web.StreamResponse, turn: Turn) -> bool:
        """Send the rest of the committed turn and the closing events; whether the text streamed differs
        from the recorded message (a parser re-read text already sent)."""
        ...

    async def fail(self, response: web.StreamResponse, error: RequestError) -> None:
        """Report a failure after the stream started, in the stream."""
        ...

    async def end(self, response: web.StreamResponse) -> None:
        """Close the stream (``[DONE]`` where the API has one)."""
        ...


class StreamedText:
    """The stable reasoning and text of a reply being sampled, as deltas that add up to the recorded message.

    Text is sent once stable: each time, the tokens so far are parsed by the renderer and only what extends
    the text already sent is sent (``TextDeltas``: a half-sampled UTF-8 character, and whitespace at either
    end, which the parser strips from a finished reply, wait). Text that may be the start of a stop string
    waits until it is known not to be.
    """

    def __init__(self, renderer: TITORenderer, chat: ChatCompletionRequest):
        self.content = TextDeltas(strip=True)  # parsers strip the reply
        self.reasoning = TextDeltas(strip=True)
        self.stops = stop_strings(chat)
        self.tools = normalize_tools(chat.tools)
        # The renderer the turn is parsed with (a thinking variant when the request switches it).
        thinking = (chat.chat_template_kwargs or {}).get("enable_thinking")
        variant = renderer.variant(enable_thinking=thinking) if thinking is not None else None
        self.renderer = variant or renderer

    @property
    def diverged(self) -> bool:
        return self.content.diverged or self.reasoning.diverged

    def update(self, progress: TurnProgress) -> tuple[str, str]:
        """(reasoning, content) the tokens so far add to what was sent."""
        parsed = self.renderer.parse(progress.token_ids, self.tools, progress.prompt_ids)
        reasoning_text, content_text = parsed.reasoning_content or "", parsed.content
        if self.stops:
            reasoning_text, content_text = (
                hold_back(reasoning_text, self.stops),
                hold_back(content_text, self.stops),
            )
        return self.reasoning.update(reasoning_text), self.content.update(content_text)

    def finish(self, message: dict[str, Any]) -> tuple[str, str]:
        """(reasoning, content) still to send of the committed ``message``."""
        reasoning = self.reasoning.update(message.get("reasoning_content") or "", final=True)
        return reasoning, self.content.update(message["content"] or "", final=True)


async def stream_turn(
    request: web.Request,
    session: Session,
    chat: ChatCompletionRequest,
    request_key: str | None,
    is_retry: bool,
    writer_for: Callable[[str, int], TurnWriter],
    *,
    side_call: str | None = None,
) -> web.StreamResponse:
    """Stream one turn (``side_call``: its side-call kind, see ``Session.complete``):
    ``writer_for(response_id, created)`` writes its events as tokens arrive.

    Parsing backs off (``PARSE_BACKOFF``), so that it stays a small share of the time however long the reply
    grows. A request refused before its first token is answered as a JSON error (raised); after, the error
    goes into the stream. A client that disconnects cancels the turn, which aborts the engine request. A
    stream whose text differs from the recorded message is counted in ``stats.streams_diverged``.
    """
    woke = asyncio.Event()
    latest: list[TurnProgress] = []

    def on_tokens(progress: TurnProgress) -> None:
        latest[:] = [progress]
        woke.set()

    turn_task = asyncio.ensure_future(
        session.complete(
            chat, request_key=request_key, is_retry=is_retry, on_tokens=on_tokens, side_call=side_call
        )
    )
    try:
        await _until(turn_task, woke)
        if turn_task.done():  # sampled before any token was seen (or failed): errors stay JSON
            (turn,) = turn_task.result()
            writer = writer_for(turn.response_id, turn.created)
            response = await writer.start(request)
            if await writer.finish(response, turn):
                session.trace.stats.streams_diverged += 1
            await writer.end(response)
            return response
        writer = writer_for(latest[0].response_id, int(time.time()))
        response = await writer.start(request)
        while not turn_task.done():
            if woke.is_set():
                woke.clear()
                started = time.perf_counter()
                await writer.progress(response, latest[0])
                backoff_s = PARSE_BACKOFF * (time.perf_counter() - started)
                await asyncio.wait((turn_task,), timeout=backoff_s)
            await _until(turn_task, woke)
        try:
            (turn,) = turn_task.result()
        except RequestError as error:  # the stream had started: report in the stream
            await writer.fail(response, error)
        except TraceSealedError as error:
            await writer.fail(response, RequestError(str(error), code="session_closed"))
        else:
            if await writer.finish(response, turn):
                session.trace.stats.streams_diverged += 1
        await writer.end(response)
        return response
    finally:
        if not turn_task.done():
            turn_task.cancel()  # the client went away: session.complete aborts the engine request
            with contextlib.suppress(asyncio.CancelledError, RollflowError):
                await turn_task


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """An SSE response with its headers sent."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _until(task: asyncio.Future, event: asyncio.Event) -> None:
    """Wait until ``task`` is done or ``event`` is set."""
    if task.done() or event.is_set():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
