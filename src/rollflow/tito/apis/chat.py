"""OpenAI Chat Completions (``POST /v1/chat/completions``, streamed and not): recorded turns as a
``ChatCompletion``, and the SSE chunks of a streamed turn."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from aiohttp import web

from rollflow.errors import RequestError
from rollflow.http.sse import SSE_DONE, sse_event
from rollflow.tito.apis.common import TurnRequest
from rollflow.tito.apis.streaming import StreamedText, open_event_stream
from rollflow.tito.renderer import TITORenderer
from rollflow.tito.session import Session, TurnProgress, arguments_text
from rollflow.tito.trace import Turn
from rollflow.tito.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ResponseFunction,
    ResponseMessage,
    ResponseToolCall,
    TokenLogprob,
    Usage,
    decode_request,
)

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy

log = structlog.get_logger(__name__)


def prompt_ids(turn: Turn) -> list[int]:
    """The token ids of the prompt a turn was sampled from."""
    return turn.node.prefix_ids()[: turn.prompt_len].tolist()


def token_logprobs(renderer: TITORenderer, token_ids: list[int], logprobs: list[float]) -> ChoiceLogprobs:
    """``logprobs.content`` of these tokens: each one's text, logprob and bytes."""
    content = []
    for token_id, logprob in zip(token_ids, logprobs, strict=True):
        text, raw = renderer.token_text_and_bytes(token_id)
        content.append(TokenLogprob(text, logprob, raw))
    return ChoiceLogprobs(content)


def chat_completion(
    chat: ChatCompletionRequest, turns: list[Turn], model_name: str, renderer: TITORenderer
) -> ChatCompletion:
    """The ``ChatCompletion`` of a request's recorded turns (one choice per turn)."""
    choices = []
    completion_len = 0
    for index, turn in enumerate(turns):
        message = turn.message
        calls = [
            ResponseToolCall(
                c["id"], ResponseFunction(c["function"]["name"], arguments_text(c["function"]["arguments"]))
            )
            for c in message.get("tool_calls", ())
        ]
        response = ResponseMessage(
            role="assistant",
            content=message["content"] if message["content"] or not calls else None,
            reasoning_content=message.get("reasoning_content"),
            tool_calls=calls or None,
        )
        completion_ids = turn.completion_ids
        completion_len += len(completion_ids)
        choices.append(
            Choice(
                response,
                turn.finish_reason,
                index=index,
                logprobs=token_logprobs(renderer, completion_ids, turn.logprobs) if chat.logprobs else None,
                stop_reason=turn.options.get("stop_reason"),
                token_ids=completion_ids if chat.return_token_ids else msgspec.UNSET,
            )
        )
    first = turns[0]
    return ChatCompletion(
        id=first.response_id,
        created=first.created,
        model=model_name,
        choices=choices,
        usage=Usage(first.prompt_len, completion_len, first.prompt_len + completion_len),
        prompt_token_ids=prompt_ids(first) if chat.return_token_ids else msgspec.UNSET,
    )


def prepare_chat(proxy: TITOProxy, session: Session, body: bytes) -> TurnRequest:
    """A Chat Completions request body decoded and validated, with its answers (``ChatCompletion``, chunks):
    what ``POST /sessions/<token>/v1/chat/completions`` serves, from the front and from aiohttp.
    ``session`` is unused (the request carries its whole history); it is there to match the other APIs.

    Raises:
        RequestError: malformed JSON, a wrong type or value (400 naming the field).
    """
    decoded = decode_request(body, strict=proxy.strict_requests, max_n=proxy.max_n)
    chat, model_name, renderer = decoded.request, proxy.settings.model_name, proxy.renderer

    def reply(turns: list[Turn]) -> ChatCompletion:
        return chat_completion(chat, turns, model_name, renderer)

    def writer_for(response_id: str, created: int) -> ChatStream:
        return ChatStream(chat, response_id, created, model_name=model_name, renderer=renderer)

    return TurnRequest("chat", decoded, reply, writer_for)


class ChatStream:
    """The SSE chunks of one streamed chat completion (a ``TurnWriter``): role, then content (and reasoning)
    deltas as tokens arrive, then the finish chunk (+ usage), [DONE].

    Tool calls come whole in the finish chunk: the renderer parses them from the whole reply, and partial
    tool-call JSON is of no use to an agent. The finish chunk also completes the text from the committed turn,
    so the concatenated deltas equal the non-streamed message.
    """

    def __init__(
        self,
        chat: ChatCompletionRequest,
        response_id: str,
        created: int,
        *,
        model_name: str,
        renderer: TITORenderer,
    ):
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model_name = model_name
        self.renderer = renderer
        self.text = StreamedText(renderer, chat)
        self.logprobs_sent = 0

    def _chunk(self, delta: Delta, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = ChunkChoice(delta, 0, finish, logprobs)
        return sse_event(ChatCompletionChunk(self.response_id, self.created, self.model_name, [choice]))

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> ChoiceLogprobs | None:
        """Logprobs of the tokens not reported yet (with ``logprobs: true``)."""
        if not self.chat.logprobs:
            return None
        start, self.logprobs_sent = self.logprobs_sent, len(token_ids)
        return token_logprobs(self.renderer, token_ids[start:], logprobs[start:])

    async def start(self, request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        await response.write(self._chunk(Delta(role="assistant", content="")))
        return response

    async def progress(self, response: web.StreamResponse, progress: TurnProgress) -> None:
        reasoning, content = self.text.update(progress)
        if reasoning or content:
            delta = Delta(content=content or None, reasoning_content=reasoning or None)
            await response.write(
                self._chunk(delta, logprobs=self._logprobs(progress.token_ids, progress.logprobs))
            )

    async def finish(self, response: web.StreamResponse, turn: Turn) -> bool:
        completion = chat_completion(self.chat, [turn], self.model_name, self.renderer)
        choice = completion.choices[0]
        message = choice.message
        reasoning, content = self.text.finish(turn.message)
        diverged = self.text.diverged
        if diverged:
            # A parser re-read text already sent (e.g. a late reasoning end): the agent's copy differs.
            log.warning("streamed text differs from the recorded message", response_id=self.response_id)
        calls = [
            DeltaToolCall(
                index, call.id, "function", DeltaFunction(call.function.name, call.function.arguments)
            )
            for index, call in enumerate(message.tool_calls or ())
        ]
        delta = Delta(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)
        finish = ChunkChoice(
            delta,
            0,
            choice.finish_reason,
            self._logprobs(turn.completion_ids, turn.logprobs),
            stop_reason=choice.stop_reason if choice.stop_reason is not None else msgspec.UNSET,
            token_ids=choice.token_ids,
        )
        chunk = ChatCompletionChunk(
            self.response_id,
            self.created,
            self.model_name,
            [finish],
            prompt_token_ids=completion.prompt_token_ids,
        )
        parts = [sse_event(chunk)]
        if self.chat.stream_options is not None and self.chat.stream_options.include_usage:
            usage = ChatCompletionChunk(self.response_id, self.created, self.model_name, [], completion.usage)
            parts.append(sse_event(usage))
        await response.write(b"".join(parts))
        return diverged

    async def fail(self, response: web.StreamResponse, error: RequestError) -> None:
        await response.write(sse_event(error.body()))

    async def end(self, response: web.StreamResponse) -> None:
        await response.write(SSE_DONE)
        await response.write_eof()
