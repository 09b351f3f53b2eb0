"""The Anthropic Messages API (``POST /v1/messages``, streamed and not, and ``/v1/messages/count_tokens``)
over the session's turn pipeline.

A request becomes the internal ``ChatCompletionRequest``: ``system`` a system message first; a user
message's ``tool_result`` blocks tool messages and its text one user message; an assistant message's
``thinking`` its reasoning, its text its content and its ``tool_use`` blocks its tool calls (the block's
``id`` is the call's id). So a reply sent back as the blocks the proxy returned reads back as exactly the
recorded message, and turns of this API and of the OpenAI ones share their prefix in a session's tree.

A ``thinking`` block carries a signature, an HMAC of its text keyed by the session's secret URL token: a
thinking block the session did not produce is refused (400), since training on made-up reasoning would
attribute it to the policy. ``redacted_thinking`` blocks carry nothing the model reads and are dropped, as a
client that leaves reasoning out (the trace matches such a history with the recorded turn). ``thinking:
{"type": "enabled" | "disabled"}`` is the template's thinking switch; ``budget_tokens`` cannot be enforced.

Errors have the API's own shape, ``{"type": "error", "error": {"type": "invalid_request_error", "message"}}``
(``error`` events in a stream), with the proxy's usual statuses.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from rollflow.errors import RequestError
from rollflow.inference.prompt_limits import OFFLOAD_CHARS, rendered_chars
from rollflow.tito.apis.common import (
    TurnRequest,
    error_answer,
    leave_aside,
    refuse,
    serve_request,
    tool_input,
    turn_hex,
    validate_chat,
)
from rollflow.tito.apis.streaming import StreamedText, open_event_stream
from rollflow.tito.renderer import normalize_message, normalize_tools
from rollflow.tito.session import Session, TurnProgress
from rollflow.tito.trace import Turn
from rollflow.tito.wire import (
    ChatCompletionRequest,
    ChatMessage,
    DecodedRequest,
    FunctionCall,
    FunctionDef,
    Tool,
    ToolCall,
    decode_body,
)
from rollflow.tito.wire_anthropic import Block, MessagesRequest

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy

_ENCODER = msgspec.json.Encoder()
# Chat Completions field → the Messages field it came from (error messages name the request's own fields).
_RENAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
# The API's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

Handler = Callable[["TITOProxy", web.Request], Awaitable[web.StreamResponse]]


def error_body(status: int, message: str) -> dict[str, Any]:
    """The Anthropic error body for a status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_answer(error: Exception) -> tuple[int, dict[str, Any]]:
    """(status, Anthropic error body) for an exception a request handler raised (``error_answer``'s status
    and message): the same for aiohttp and the front."""
    status, body = error_answer(error)
    return status, error_body(status, body["error"]["message"])


def anthropic_errors(handler: Handler) -> Handler:
    """``handler`` answering its errors in the Anthropic shape (the proxy's middleware answers OpenAI's)."""

    @functools.wraps(handler)
    async def answer(proxy: TITOProxy, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(proxy, request)
        except web.HTTPException as error:  # aiohttp's own: a body over the size limit
            status, data = error.status, error_body(error.status, error.reason or error.text or "")
        except Exception as error:
            status, data = anthropic_error_answer(error)
        return web.Response(status=status, body=_ENCODER.encode(data), content_type="application/json")

    return answer


@anthropic_errors
async def create_message(proxy: TITOProxy, request: web.Request) -> web.StreamResponse:
    """``POST /sessions/<token>/v1/messages`` (aiohttp's route; the front serves ``prepare_message`` too)."""
    return await serve_request(prepare_message, proxy, request)


def prepare_message(proxy: TITOProxy, session: Session, body: bytes) -> TurnRequest:
    """A Messages request body decoded and translated, with its answers (``Message``, stream events) and
    errors in the Anthropic shape.

    Raises:
        RequestError: malformed JSON, a wrong type, no ``max_tokens``, a block the proxy refuses (400
            naming the field).
    """
    wire, unknown = decode_body(body, MessagesRequest, strict=proxy.strict_requests)
    if wire.max_tokens is None:
        raise refuse("max_tokens", "required", code="invalid_request")
    ignored: list[str] = []
    chat = to_chat(wire, session, strict=proxy.strict_requests, ignored=ignored)
    model_name, key = proxy.settings.model_name, session.token

    def reply(turns: list[Turn]) -> dict[str, Any]:
        (turn,) = turns
        return message_object(turn, key, model_name)

    def writer_for(response_id: str, created: int) -> MessageStream:
        return MessageStream(chat, response_id, key, model_name=model_name, renderer=proxy.renderer)

    decoded = DecodedRequest(chat, unknown, ignored)
    return TurnRequest("messages", decoded, reply, writer_for, anthropic_error_answer)


@anthropic_errors
async def count_tokens(proxy: TITOProxy, request: web.Request) -> web.StreamResponse:
    """``POST /sessions/<token>/v1/messages/count_tokens``: the tokens of the prompt this request would be
    sampled from in this session."""
    session = proxy.session_for(request)
    body = await proxy.read_body(request)
    wire, _ = decode_body(body, MessagesRequest, strict=proxy.strict_requests)
    chat = to_chat(wire, session, strict=proxy.strict_requests, ignored=[])
    side_model = proxy.side_calls is not None and proxy.side_calls.model_kind(chat.model) is not None
    if chat.model != proxy.settings.model_name and not side_model:
        raise RequestError(
            f"model {chat.model!r} is not served here; use {proxy.settings.model_name!r}",
            status=404,
            param="model",
        )
    messages = [normalize_message(message) for message in chat.messages]
    tools = normalize_tools(chat.tools)
    thinking = (chat.chat_template_kwargs or {}).get("enable_thinking")
    renderer = (
        proxy.renderer.variant(enable_thinking=thinking) if thinking is not None else None
    ) or proxy.renderer
    # Rendered against the tree, as a turn would be (the bridge keeps recorded tokens a full render may
    # drop, such as earlier reasoning), and not committed.
    prepared = await session.trace.prepare(
        messages, tools, renderer=renderer, offload=rendered_chars(messages, tools) > OFFLOAD_CHARS
    )
    return web.Response(
        body=_ENCODER.encode({"input_tokens": len(prepared.prompt)}), content_type="application/json"
    )


# ---------------------------------------------------------------------------------------------- request


def to_chat(
    wire: MessagesRequest, session: Session, *, strict: bool, ignored: list[str]
) -> ChatCompletionRequest:
    """The internal request for a Messages request (see the module docstring).

    Raises:
        RequestError: a block the proxy refuses (images, documents, server tools), a ``tool_result`` without
            its ``tool_use``, a ``thinking`` block this session did not produce (400 naming the field).
    """
    messages: list[ChatMessage] = []
    if wire.system:
        messages.append(ChatMessage(role="system", content=_text(wire.system, "system")))
    call_ids: set[str] = set()
    for i, message in enumerate(wire.messages):
        where = f"messages[{i}]"
        if message.role == "user":
            messages += _user_messages(message.content, where, call_ids)
        elif message.role == "assistant":
            messages.append(_assistant_message(message.content, where, call_ids, session.token))
        elif message.role == "system":
            # A system message inside the conversation (Claude Code sends them, beta
            # "mid-conversation-system"): a system turn where it stands, as the chat template renders one.
            messages.append(ChatMessage(role="system", content=_text(message.content, f"{where}.content")))
        else:
            raise refuse(f"{where}.role", f"must be user, assistant or system, got {message.role!r}")
    kwargs = dict(wire.chat_template_kwargs or {})
    if wire.thinking is not None:
        kind = wire.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise refuse("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
        if kind != "adaptive":  # adaptive: the model decides, so the template's own default applies
            kwargs["enable_thinking"] = kind == "enabled"
        if "budget_tokens" in wire.thinking:
            leave_aside(
                ignored, "thinking.budget_tokens", "a thinking budget cannot be enforced", strict=strict
            )
    tool_choice, parallel = _tool_choice(wire.tool_choice)
    chat = ChatCompletionRequest(
        model=wire.model,
        messages=messages,
        tools=[_tool(i, tool) for i, tool in enumerate(wire.tools or ())] or None,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        seed=wire.seed,
        max_tokens=wire.max_tokens,
        stop=wire.stop_sequences or None,
        stream=wire.stream,
        chat_template_kwargs=kwargs or None,
        metadata=wire.metadata,
    )
    validate_chat(chat, strict=strict, ignored=ignored, renames=_RENAMES)
    return chat


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise _unsupported(block, f"{where}[{j}]", "text")
        texts.append(block.text)
    return "\n".join(texts)


def _unsupported(block: Block, where: str, expected: str) -> RequestError:
    if block.type in ("image", "document", "search_result", "container_upload"):
        return refuse(
            f"{where}.type", f"{block.type} blocks are not supported: this proxy serves a text model"
        )
    return refuse(f"{where}.type", f"expected {expected} here, got a {block.type!r} block")


def _user_messages(content: str | list[Block], where: str, call_ids: set[str]) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        if block.type == "tool_result":
            if texts:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            if block.tool_use_id not in call_ids:
                raise refuse(
                    f"{here}.tool_use_id",
                    f"no tool_use with id {block.tool_use_id!r} comes before this tool_result",
                    code="invalid_value",
                )
            result = _text(block.content, f"{here}.content")
            out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
        elif block.type == "text" and block.text is not None:
            texts.append(block.text)
        else:
            raise _unsupported(block, here, "text or tool_result")
    if texts:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    if not out:
        raise refuse(f"{where}.content", "a user message needs at least one block")
    return out


def _assistant_message(content: str | list[Block], where: str, call_ids: set[str], key: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts: list[str] = []
    reasoning: str | None = None
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking":
            if (
                block.thinking is None
                or block.signature is None
                or not hmac.compare_digest(block.signature, thinking_signature(key, block.thinking))
            ):
                raise refuse(
                    f"{here}.signature",
                    "this thinking block was not produced by this session; send back the thinking blocks the "
                    "session returned, unchanged, or leave them out",
                    code="invalid_value",
                )
            reasoning = block.thinking
        elif block.type == "redacted_thinking":
            continue  # nothing the model reads: as a history that leaves the reasoning out
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise refuse(here, "a tool_use block needs its id and name")
            arguments = json.dumps(block.input if block.input is not None else {})
            calls.append(ToolCall(FunctionCall(block.name, arguments), id=block.id))
            call_ids.add(block.id)
        else:
            raise _unsupported(block, here, "text, thinking or tool_use")
    return ChatMessage(
        role="assistant", content="\n".join(texts), tool_calls=calls or None, reasoning_content=reasoning
    )


def thinking_signature(key: str, thinking: str) -> str:
    """The signature of a thinking block this session produced: an HMAC of its text under the session's key."""
    digest = hmac.new(key.encode(), thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def _tool(index: int, tool: Any) -> Tool:
    if tool.type not in (None, "custom"):
        raise refuse(f"tools[{index}].type", f"only the client's own tools are supported, got {tool.type!r}")
    return Tool(FunctionDef(tool.name, tool.description, tool.input_schema))


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(Chat Completions ``tool_choice``, ``parallel_tool_calls``) of a Messages ``tool_choice``."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise refuse("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")


# --------------------------------------------------------------------------------------------- response


def stop_reason(turn: Turn) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a recorded turn."""
    if turn.finish_reason == "length":
        return "max_tokens", None
    if turn.finish_reason == "tool_calls":
        return "tool_use", None
    stop = turn.options.get("stop_reason")
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def content_blocks(message: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The content blocks of a recorded assistant message: thinking (signed), text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        thinking = message["reasoning_content"]
        blocks.append(
            {"type": "thinking", "thinking": thinking, "signature": thinking_signature(key, thinking)}
        )
    calls = message.get("tool_calls", ())
    if message["content"] or not calls:
        blocks.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": tool_input(function["arguments"]),
            }
        )
    return blocks


def message_object(turn: Turn, key: str, model_name: str) -> dict[str, Any]:
    """The Messages API response of a recorded turn."""
    reason, sequence = stop_reason(turn)
    return {
        "id": f"msg_{turn_hex(turn.response_id)}",
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": content_blocks(turn.message, key),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(turn.prompt_len, len(turn.completion_ids)),
    }


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class MessageStream:
    """The SSE events of one streamed message (a ``TurnWriter``), as the ``anthropic`` SDK accumulates them:
    ``message_start``; a thinking block (``thinking_delta``, then its ``signature_delta``) and a text block
    (``text_delta``) as their text is sampled; each ``tool_use`` block whole (one ``input_json_delta``);
    ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(
        self, chat: ChatCompletionRequest, response_id: str, key: str, *, model_name: str, renderer: Any
    ):
        self.response_id = response_id
        self.key = key
        self.model_name = model_name
        self.text = StreamedText(renderer, chat)
        self.blocks = 0  # content blocks opened so far
        self.thinking_index: int | None = None  # the open thinking block
        self.thinking_sent = ""
        self.text_index: int | None = None  # the open text block

    @staticmethod
    def _event(type_: str, **fields: Any) -> bytes:
        return (
            b"event: " + type_.encode() + b"\ndata: " + _ENCODER.encode({"type": type_, **fields}) + b"\n\n"
        )

    async def start(self, request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        message = {
            "id": f"msg_{turn_hex(self.response_id)}",
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(0, 0),
        }
        await response.write(self._event("message_start", message=message))
        return response

    def _open(self, block: dict[str, Any]) -> tuple[int, bytes]:
        index, self.blocks = self.blocks, self.blocks + 1
        return index, self._event("content_block_start", index=index, content_block=block)

    def _thinking(self, delta: str) -> bytes:
        if not delta or self.text_index is not None:
            return b""  # thinking after the text began cannot go out in order; the signature covers what did
        out = b""
        if self.thinking_index is None:
            self.thinking_index, out = self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thinking_sent += delta
        delta_block = {"type": "thinking_delta", "thinking": delta}
        return out + self._event("content_block_delta", index=self.thinking_index, delta=delta_block)

    def _close_thinking(self) -> bytes:
        if self.thinking_index is None:
            return b""
        index, self.thinking_index = self.thinking_index, None
        signature = {"type": "signature_delta", "signature": thinking_signature(self.key, self.thinking_sent)}
        return self._event("content_block_delta", index=index, delta=signature) + self._event(
            "content_block_stop", index=index
        )

    def _text(self, delta: str) -> bytes:
        out = b""
        if self.text_index is None:
            out += self._close_thinking()
            self.text_index, opened = self._open({"type": "text", "text": ""})
            out += opened
        if delta:
            out += self._event(
                "content_block_delta", index=self.text_index, delta={"type": "text_delta", "text": delta}
            )
        return out

    async def progress(self, response: web.StreamResponse, progress: TurnProgress) -> None:
        thinking, content = self.text.update(progress)
        events = self._thinking(thinking) + (self._text(content) if content else b"")
        if events:
            await response.write(events)

    async def finish(self, response: web.StreamResponse, turn: Turn) -> bool:
        message = turn.message
        thinking, content = self.text.finish(message)
        out = self._thinking(thinking)
        calls = message.get("tool_calls", ())
        if content or self.text_index is not None or not calls:
            out += self._text(content)
            out += self._event("content_block_stop", index=self.text_index)
        else:
            out += self._close_thinking()
        for call in calls:
            function = call["function"]
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            index, opened = self._open(block)
            arguments = json.dumps(tool_input(function["arguments"]))
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out += opened + self._event("content_block_delta", index=index, delta=delta)
            out += self._event("content_block_stop", index=index)
        reason, sequence = stop_reason(turn)
        usage = _usage(turn.prompt_len, len(turn.completion_ids))
        out += self._event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage
        )
        await response.write(out + self._event("message_stop"))
        return self.text.diverged

    async def fail(self, response: web.StreamResponse, error: RequestError) -> None:
        await response.write(self._event("error", error=error_body(error.status, error.message)["error"]))

    async def end(self, response: web.StreamResponse) -> None:
        await response.write_eof()
