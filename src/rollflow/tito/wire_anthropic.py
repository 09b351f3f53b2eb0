"""Anthropic Messages API request types (the subset the TITO proxy serves), decoded with msgspec.

Content blocks are one permissive Struct (``Block``) rather than a tagged union, so that a block the proxy
does not serve (an image, a document) is refused by its ``type``, naming it, rather than failing to decode;
``rollflow.tito.apis.anthropic`` checks each block's fields for its type. Unknown fields are dropped and
counted, or refused with ``agent.strict_requests`` (``rollflow.tito.wire.decode_body``). No torch.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Block(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A content block: ``text``, ``tool_use``, ``tool_result``, ``thinking``, ``redacted_thinking``."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking / redacted_thinking
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    # Image and document blocks: named so that they are refused by type.
    source: Any = None
    # Hints and fields the SDK sends back with blocks it received; they do not change the tokens.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None
    caller: Any = None
    toolset_name: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: str | list[Block]


class AnthropicTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    # "custom" (or absent) for the client's own tools; others are Anthropic's server tools, refused.
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A ``POST /v1/messages`` body (and, without ``max_tokens``, a ``count_tokens`` one)."""

    model: str
    messages: list[Message]
    max_tokens: int | None = None
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # {"type": "enabled" | "disabled"}: the template's thinking switch (``enable_thinking``).
    thinking: dict[str, Any] | None = None
    # vLLM's extras, as for Chat Completions.
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored: they do not affect sampling.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
