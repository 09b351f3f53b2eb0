"""The OpenAI Responses API (``POST /v1/responses``, streamed and not) over the session's turn pipeline.

A request becomes the internal ``ChatCompletionRequest``: ``instructions`` a system message first, input
messages their roles (``developer`` as ``system``), a ``reasoning`` item the reasoning of the assistant
message that follows it, an assistant message and the ``function_call`` items after it one assistant message
with its tool calls (``call_id`` is the call's id), a ``function_call_output`` a tool message. So a reply sent
back as the items the proxy returned reads back as exactly the recorded message, and a Responses turn and a
Chat Completions turn of one session share their prefix in the tree.

``previous_response_id`` names a response of this session: its recorded history (without its
``instructions``, which the API does not carry over) comes before ``input``. Nothing is stored for it beyond
the tree itself. Image and file inputs, hosted tools, background runs, conversations and prompt templates
are refused (400 naming the field). Usage counts the exact tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from rollflow.errors import RequestError
from rollflow.tito.apis.common import (
    TurnRequest,
    history_message,
    leave_aside,
    refuse,
    turn_hex,
    validate_chat,
)
from rollflow.tito.apis.streaming import StreamedText, open_event_stream
from rollflow.tito.session import Session, TurnProgress, arguments_text
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
from rollflow.tito.wire_responses import ContentPart, InputItem, ResponsesRequest

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy

# Chat Completions field → the Responses field it came from (error messages name the request's own fields).
_RENAMES = {
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
    "messages": "input",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# Per session: ids of responses whose first message came from their ``instructions``.
_WITH_INSTRUCTIONS = "responses.with_instructions"
_ENCODER = msgspec.json.Encoder()


def prepare_response(proxy: TITOProxy, session: Session, body: bytes) -> TurnRequest:
    """A Responses request body decoded and translated, with its answers (``Response``, stream events): what
    ``POST /sessions/<token>/v1/responses`` serves, from the front and from aiohttp.

    Raises:
        RequestError: malformed JSON, a wrong type, a field or item the proxy refuses (400 naming it).
    """
    wire, unknown = decode_body(body, ResponsesRequest, strict=proxy.strict_requests)
    ignored: list[str] = []
    chat, instructed = to_chat(wire, session, strict=proxy.strict_requests, ignored=ignored)
    model_name = proxy.settings.model_name

    def recorded(turn: Turn) -> None:
        if instructed:  # previous_response_id leaves this response's instructions behind
            session.api_state.setdefault(_WITH_INSTRUCTIONS, set()).add(turn.response_id)

    def reply(turns: list[Turn]) -> dict[str, Any]:
        (turn,) = turns
        recorded(turn)
        return response_object(wire, turn, model_name)

    def writer_for(response_id: str, created: int) -> ResponseStream:
        return ResponseStream(
            wire, chat, response_id, created, model_name=model_name, renderer=proxy.renderer, on_turn=recorded
        )

    return TurnRequest("responses", DecodedRequest(chat, unknown, ignored), reply, writer_for)


# ---------------------------------------------------------------------------------------------- request


def to_chat(
    wire: ResponsesRequest, session: Session, *, strict: bool, ignored: list[str]
) -> tuple[ChatCompletionRequest, bool]:
    """The internal request for a Responses request, and whether its first message is its ``instructions``.

    Raises:
        RequestError: a field the proxy refuses, an item of the wrong shape, a ``function_call_output``
            without its ``function_call``, an unknown ``previous_response_id`` (400 naming the field).
    """
    if wire.background:
        raise refuse("background", "background responses are not supported; leave it unset")
    if wire.conversation is not None:
        raise refuse(
            "conversation", "conversations are not stored here; send the history, or previous_response_id"
        )
    if wire.prompt is not None:
        raise refuse("prompt", "prompt templates are not supported; send the instructions and input")
    if wire.truncation not in (None, "disabled"):
        leave_aside(
            ignored,
            "truncation",
            f"{wire.truncation!r} cannot be applied; nothing is truncated",
            strict=strict,
        )
    if wire.max_tool_calls is not None:
        leave_aside(ignored, "max_tool_calls", "cannot be enforced; the model decides", strict=strict)
    messages: list[ChatMessage] = []
    if wire.instructions:
        messages.append(ChatMessage(role="system", content=wire.instructions))
    if wire.previous_response_id is not None:
        messages += _previous_history(session, wire.previous_response_id)
    items = [InputItem(role="user", content=wire.input)] if isinstance(wire.input, str) else wire.input
    messages += _input_messages(items, messages)
    if not messages:
        raise refuse("input", "must hold at least one item")
    chat = ChatCompletionRequest(
        model=wire.model,
        messages=messages,
        tools=_tools(wire.tools or (), strict=strict, ignored=ignored) or None,
        tool_choice=_tool_choice(wire.tool_choice),
        parallel_tool_calls=wire.parallel_tool_calls,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        seed=wire.seed,
        max_tokens=wire.max_output_tokens,
        stream=wire.stream,
        top_logprobs=wire.top_logprobs,
        reasoning_effort=wire.reasoning.effort if wire.reasoning is not None else None,
        response_format=wire.text.format if wire.text is not None else None,
        chat_template_kwargs=wire.chat_template_kwargs,
        user=wire.user,
        metadata=wire.metadata,
        store=wire.store,
    )
    validate_chat(chat, strict=strict, ignored=ignored, renames=_RENAMES)
    return chat, bool(wire.instructions)


def _previous_history(session: Session, response_id: str) -> list[ChatMessage]:
    """The recorded messages up to and including the response ``response_id`` of this session, without the
    system message its ``instructions`` made."""
    turn = _find_turn(session, response_id)
    if turn is None:
        raise refuse(
            "previous_response_id",
            f"no response {response_id!r} in this session (responses are kept per session, for its lifetime)",
            code="previous_response_not_found",
        )
    path = [node.message for node in turn.node.path()]
    if turn.response_id in session.api_state.get(_WITH_INSTRUCTIONS, ()):
        path = path[1:]
    return [history_message(message) for message in path]


def _find_turn(session: Session, response_id: str) -> Turn | None:
    if not response_id.startswith("resp_"):
        return None
    wanted = turn_hex(response_id.removeprefix("resp_"))
    turns = session.trace.turns
    for index in range(len(turns) - 1, -1, -1):
        if turn_hex(turns[index].response_id) == wanted:
            return turns[index]
    return None


def _text(parts: str | list[ContentPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for j, part in enumerate(parts):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise refuse(
                f"{where}[{j}].type", f"{part.type} is not supported: this proxy serves a text model"
            )
        if part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        else:
            raise refuse(
                f"{where}[{j}].type", f"expected input_text or output_text with text, got {part.type!r}"
            )
    return "\n".join(texts)


def _input_messages(items: list[InputItem], before: list[ChatMessage]) -> list[ChatMessage]:
    """Chat messages of the input items (see the module docstring); ``before``: the messages ahead of them."""
    call_ids = {call.id for message in before for call in message.tool_calls or ()}
    out: list[ChatMessage] = []
    pending: ChatMessage | None = None  # the assistant message being assembled from items

    def assistant() -> ChatMessage:
        nonlocal pending
        if pending is None:
            pending = ChatMessage(role="assistant", content="")
            out.append(pending)
        return pending

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "reasoning":
            if pending is not None and (pending.content or pending.tool_calls or pending.reasoning_content):
                pending = None  # reasoning starts the next assistant turn
            text = _text(item.content, f"{where}.content") or _text(item.summary, f"{where}.summary")
            assistant().reasoning_content = text or None
        elif item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise refuse(where, "a function_call needs call_id and name")
            message = assistant()
            call = ToolCall(FunctionCall(item.name, item.arguments or "{}"), id=item.call_id)
            message.tool_calls = [*(message.tool_calls or ()), call]
            call_ids.add(item.call_id)
        elif item.type == "function_call_output":
            pending = None
            if item.call_id is None:
                raise refuse(
                    f"{where}.call_id", "a function_call_output needs the call_id of its function_call"
                )
            if item.call_id not in call_ids:
                raise refuse(
                    f"{where}.call_id",
                    f"no function_call with call_id {item.call_id!r} comes before this output",
                    code="invalid_value",
                )
            out.append(
                ChatMessage(
                    role="tool", content=_text(item.output, f"{where}.output"), tool_call_id=item.call_id
                )
            )
        elif item.type == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise refuse(
                    f"{where}.role", f"must be user, system, developer or assistant, got {item.role!r}"
                )
            text = _text(item.content, f"{where}.content")
            if item.role == "assistant":
                if pending is not None and (pending.content or pending.tool_calls):
                    pending = None
                assistant().content = text
            else:
                pending = None
                out.append(ChatMessage(role=item.role, content=text))
        else:
            raise refuse(
                f"{where}.type",
                f"{item.type!r} items are not supported (message, function_call, function_call_output, reasoning)",
            )
    return out


def _tools(tools: Any, *, strict: bool, ignored: list[str], where: str = "tools") -> list[Tool]:
    """Function tools as the model sees them: a ``namespace``'s tools each in its place; tools that OpenAI's
    servers run (``web_search``, ``file_search``, ``mcp``, ...) cannot run here and are left out, counted (or,
    strict, refused)."""
    out: list[Tool] = []
    for index, tool in enumerate(tools):
        here = f"{where}[{index}]"
        if tool.type == "function" and tool.name:
            out.append(Tool(FunctionDef(tool.name, tool.description, tool.parameters, tool.strict)))
        elif tool.type == "namespace" and tool.tools:
            out += _tools(tool.tools, strict=strict, ignored=ignored, where=f"{here}.tools")
        elif tool.type in ("function", "namespace"):
            raise refuse(f"{here}.name", f"a {tool.type} tool needs a name (and a namespace its tools)")
        else:
            leave_aside(
                ignored,
                f"{here}.type",
                f"{tool.type!r} tools run on OpenAI's servers, not here (only function tools are served)",
                strict=strict,
            )
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# --------------------------------------------------------------------------------------------- response


def output_items(turn: Turn, message: dict[str, Any], *, status: str = "completed") -> list[dict[str, Any]]:
    """The output items of a recorded turn: reasoning, the message (unless the reply is only tool calls),
    and one ``function_call`` per tool call."""
    unique = turn_hex(turn.response_id)
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(unique, message["reasoning_content"], status))
    calls = message.get("tool_calls", ())
    if message["content"] or not calls:
        items.append(_message_item(unique, message["content"], status))
    for index, call in enumerate(calls):
        items.append(_call_item(unique, index, call, status))
    return items


def _reasoning_item(unique: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": f"rs_{unique}", "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(unique: str, text: str | None, status: str) -> dict[str, Any]:
    content = (
        [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {
        "id": f"msg_{unique}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(unique: str, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{unique}_{index}",
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments_text(call["function"]["arguments"]) if status == "completed" else "",
        "status": status,
    }


def response_object(
    wire: ResponsesRequest,
    turn: Turn | None,
    model_name: str,
    *,
    response_id: str = "",
    created: int = 0,
) -> dict[str, Any]:
    """The ``Response`` of a recorded turn; with no turn, the in-progress response a stream opens with."""
    if turn is not None:
        response_id, created = turn.response_id, turn.created
    incomplete = turn is not None and turn.finish_reason == "length"
    output_len = len(turn.completion_ids) if turn is not None else 0
    input_len = turn.prompt_len if turn is not None else 0
    return {
        "id": f"resp_{turn_hex(response_id)}",
        "object": "response",
        "created_at": created,
        "status": "in_progress" if turn is None else "incomplete" if incomplete else "completed",
        "model": model_name,
        "output": output_items(turn, turn.message) if turn is not None else [],
        "instructions": wire.instructions,
        "previous_response_id": wire.previous_response_id,
        "tools": msgspec.to_builtins(wire.tools or []),
        "tool_choice": wire.tool_choice if wire.tool_choice is not None else "auto",
        "parallel_tool_calls": wire.parallel_tool_calls is not False,
        "temperature": wire.temperature,
        "top_p": wire.top_p,
        "max_output_tokens": wire.max_output_tokens,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "metadata": wire.metadata or {},
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "store": bool(wire.store),
        "user": wire.user,
        "usage": None
        if turn is None
        else {
            "input_tokens": input_len,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_len,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_len + output_len,
        },
    }


class ResponseStream:
    """The SSE events of one streamed response (a ``TurnWriter``), in the order the openai SDK's
    ``ResponseStream`` accumulates them: ``response.created``, ``response.in_progress``; a reasoning item
    (``reasoning_text`` deltas) and a message item (``output_text`` deltas) as their text is sampled; then
    each function call whole, and ``response.completed`` (its status ``incomplete`` at the length limit)."""

    def __init__(
        self,
        wire: ResponsesRequest,
        chat: ChatCompletionRequest,
        response_id: str,
        created: int,
        *,
        model_name: str,
        renderer: Any,
        on_turn: Callable[[Turn], None],
    ):
        self.wire = wire
        self.on_turn = on_turn
        self.response_id = response_id
        self.created = created
        self.model_name = model_name
        self.unique = turn_hex(response_id)
        self.text = StreamedText(renderer, chat)
        self.sequence = 0
        self.items = 0  # output items opened so far
        self.reasoning_index: int | None = None  # the open reasoning item
        self.reasoning_sent = ""
        self.message_index: int | None = None  # the open message item

    def _event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + type_.encode() + b"\ndata: " + _ENCODER.encode(payload) + b"\n\n"

    async def start(self, request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        opening = response_object(
            self.wire, None, self.model_name, response_id=self.response_id, created=self.created
        )
        await response.write(
            self._event("response.created", response=opening)
            + self._event("response.in_progress", response=opening)
        )
        return response

    def _reasoning(self, delta: str) -> bytes:
        if not delta or self.message_index is not None:
            return b""  # reasoning after the message began cannot go out in order; the final response has it
        out = b""
        if self.reasoning_index is None:
            self.reasoning_index, self.items = self.items, self.items + 1
            item = _reasoning_item(self.unique, "", "in_progress")
            out += self._event("response.output_item.added", output_index=self.reasoning_index, item=item)
        self.reasoning_sent += delta
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=f"rs_{self.unique}",
            output_index=self.reasoning_index,
            content_index=0,
            delta=delta,
        )

    def _close_reasoning(self) -> bytes:
        if self.reasoning_index is None:
            return b""
        index, self.reasoning_index = self.reasoning_index, None
        item_id = f"rs_{self.unique}"
        return self._event(
            "response.reasoning_text.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            text=self.reasoning_sent,
        ) + self._event(
            "response.output_item.done",
            output_index=index,
            item=_reasoning_item(self.unique, self.reasoning_sent, "completed"),
        )

    def _content(self, delta: str) -> bytes:
        out = b""
        if self.message_index is None:
            out += self._close_reasoning()
            self.message_index, self.items = self.items, self.items + 1
            item = _message_item(self.unique, None, "in_progress")
            out += self._event("response.output_item.added", output_index=self.message_index, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self.message_index,
                content_index=0,
                part=part,
            )
        if delta:
            out += self._event(
                "response.output_text.delta",
                item_id=f"msg_{self.unique}",
                output_index=self.message_index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        return out

    async def progress(self, response: web.StreamResponse, progress: TurnProgress) -> None:
        reasoning, content = self.text.update(progress)
        events = self._reasoning(reasoning) + (self._content(content) if content else b"")
        if events:
            await response.write(events)

    async def finish(self, response: web.StreamResponse, turn: Turn) -> bool:
        self.on_turn(turn)
        message = turn.message
        reasoning, content = self.text.finish(message)
        out = self._reasoning(reasoning)
        calls = message.get("tool_calls", ())
        if content or self.message_index is not None or not calls:
            out += self._content(content)
            assert self.message_index is not None
            text = message["content"] or ""
            item_id = f"msg_{self.unique}"
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=self.message_index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=self.message_index,
                content_index=0,
                part=part,
            )
            out += self._event(
                "response.output_item.done",
                output_index=self.message_index,
                item=_message_item(self.unique, text, "completed"),
            )
        else:
            out += self._close_reasoning()
        for index, call in enumerate(calls):
            output_index, self.items = self.items, self.items + 1
            added = _call_item(self.unique, index, call, "in_progress")
            done = _call_item(self.unique, index, call, "completed")
            out += self._event("response.output_item.added", output_index=output_index, item=added)
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=done["id"],
                output_index=output_index,
                delta=done["arguments"],
            )
            out += self._event(
                "response.function_call_arguments.done",
                item_id=done["id"],
                output_index=output_index,
                name=done["name"],
                arguments=done["arguments"],
            )
            out += self._event("response.output_item.done", output_index=output_index, item=done)
        final = response_object(self.wire, turn, self.model_name)
        # response.completed also for an incomplete response (status "incomplete"), as vLLM sends it: the
        # SDK's stream helpers take the final response from that event only.
        await response.write(out + self._event("response.completed", response=final))
        return self.text.diverged

    async def fail(self, response: web.StreamResponse, error: RequestError) -> None:
        await response.write(self._event("error", code=error.code, message=error.message, param=error.param))

    async def end(self, response: web.StreamResponse) -> None:
        await response.write_eof()
