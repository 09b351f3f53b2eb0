"""Thread-safe adapter over a ``renderers`` renderer, plus the message normalization the trace keys on.

Request messages are normalized once (text parts joined, tool-call arguments parsed to objects, ``developer``
mapped to ``system``) so that the renderer sees what chat templates expect and so that two spellings of the
same message compare equal. Rendering itself is delegated to the renderer under one lock: renderers keep
caches that are not documented as thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from rollflow.models.special_tokens import special_token_texts, strip_special_texts
from rollflow.tito.wire import ChatMessage, Tool


@dataclass(frozen=True, slots=True)
class Rendered:
    """Token ids with, per token, the index of the message that produced it (-1: scaffolding)."""

    token_ids: list[int]
    message_indices: list[int]


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """A completion parsed back into an assistant message."""

    content: str
    reasoning_content: str | None
    # (name, arguments) of each well-formed tool call; arguments as a dict or the raw string.
    tool_calls: list[tuple[str, Any]]


class TITORenderer:
    """Serialize access to one ``renderers`` renderer (any thread may call).

    Args:
        renderer: a ``renderers`` renderer (``rollflow.models.loading.create_chat_renderer``).
        tokenizer: its tokenizer, used to decode single tokens for logprob output.
    """

    def __init__(self, renderer: Any, tokenizer: Any, *, tag: str = ""):
        self.renderer = renderer
        self.tokenizer = tokenizer
        # Tells renderings of this variant apart from the base renderer's (see ``variant``); "" for the base.
        self.tag = tag
        self._lock = threading.Lock()
        self.stop_token_ids: tuple[int, ...] = tuple(renderer.get_stop_token_ids())
        self._variants: dict[bool, TITORenderer | None] = {}
        self._special_texts = special_token_texts(tokenizer)

    def variant(self, *, enable_thinking: bool) -> TITORenderer | None:
        """This renderer with thinking switched on or off (``chat_template_kwargs.enable_thinking``), made
        once and kept; itself when it already is; None when the renderer has no such switch."""
        if enable_thinking in self._variants:
            return self._variants[enable_thinking]
        config = getattr(self.renderer, "config", None)
        fields = getattr(type(config), "model_fields", {})
        variant: TITORenderer | None = None
        if "enable_thinking" in fields:
            if config.enable_thinking == enable_thinking:
                variant = self
            else:
                import renderers

                other = renderers.create_renderer(
                    self.tokenizer, config.model_copy(update={"enable_thinking": enable_thinking})
                )
                variant = TITORenderer(other, self.tokenizer, tag=f"enable_thinking={enable_thinking}")
        self._variants[enable_thinking] = variant
        return variant

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` as vLLM's output text (special tokens skipped); stop strings match on it."""
        with self._lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def render(self, messages: list[dict], tools: list[dict] | None) -> Rendered:
        """Render the whole history with the generation prompt."""
        with self._lock:
            rendered = self.renderer.render(messages, tools=tools, add_generation_prompt=True)
        return Rendered(rendered.token_ids, rendered.message_indices)

    def bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        new_messages: list[dict],
        tools: list[dict] | None,
    ) -> Rendered | None:
        """Extend ``prompt_ids + completion_ids`` with ``new_messages`` and the generation prompt, or None
        when the renderer cannot prove the result equals a full render. Indices are relative to
        ``new_messages``."""
        with self._lock:
            rendered = self.renderer.bridge_to_next_turn(
                prompt_ids, completion_ids, new_messages, tools=tools
            )
        if rendered is None:
            return None
        return Rendered(rendered.token_ids, rendered.message_indices)

    def parse(self, completion_ids: list[int], tools: list[dict] | None, prompt_ids: list[int]) -> ParsedTurn:
        """Parse sampled tokens into content, reasoning and the well-formed tool calls."""
        from renderers import ToolCallParseStatus

        with self._lock:
            parsed = self.renderer.parse_response(completion_ids, tools=tools, prompt_ids=prompt_ids)
        calls = [
            (call.name, call.arguments if call.arguments is not None else {})
            for call in parsed.tool_calls
            if call.status == ToolCallParseStatus.OK and call.name
        ]
        content = strip_special_texts(parsed.content or "", self._special_texts)
        return ParsedTurn(content, parsed.reasoning_content or None, calls)

    def token_text(self, token_id: int) -> str:
        with self._lock:
            return self.tokenizer.decode([token_id])

    def token_text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        """The token's text decoded alone, and its own bytes (not U+FFFD's for part of a character)."""
        from rollflow.inference.token_bytes import token_bytes

        with self._lock:
            text = self.tokenizer.decode([token_id])
            return text, token_bytes(self.tokenizer, token_id, text)


# ------------------------------------------------------------------------------------------ normalization


def _arguments(raw: str) -> Any:
    # Chat templates render dict arguments as JSON; a string would be rendered quoted, so parse when we can.
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to be arguments
        return raw
    return value if isinstance(value, dict) else raw


def normalize_message(message: ChatMessage) -> dict[str, Any]:
    """A request message as a ``renderers`` message dict (plain data, stable key order)."""
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id or "",
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def normalize_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool definitions as ``renderers`` tool specs."""
    if not tools:
        return None
    return [
        {
            "name": tool.function.name,
            "description": tool.function.description or "",
            "parameters": tool.function.parameters or {"type": "object", "properties": {}},
        }
        for tool in tools
    ]


# Tools as canonical JSON (keys sorted at every level) for their digest: several times faster than
# ``json.dumps(sort_keys=True)`` on the kilobytes of tool definitions an agent sends with every request.
_TOOLS_ENCODER = msgspec.json.Encoder(order="sorted")
_NO_TOOLS_DIGEST = hashlib.blake2b(b"null", digest_size=16).digest()


def tools_key(tools: list[dict[str, Any]] | None, tag: str = "") -> bytes:
    """Digest of what a turn was rendered with besides its messages: the tools and the renderer variant's
    ``tag``; a bridge from a turn needs the same. Kept in memory only (never saved), so only equality within
    a process matters."""
    if tools is None:
        digest = _NO_TOOLS_DIGEST
    else:
        try:
            canonical = _TOOLS_ENCODER.encode(tools)
        except TypeError:  # a type msgspec does not encode (tools come from JSON, so none in practice)
            canonical = json.dumps(tools, sort_keys=True).encode()
        digest = hashlib.blake2b(canonical, digest_size=16).digest()
    return digest + tag.encode() if tag else digest
