"""OpenAI Responses API request types (the subset the TITO proxy serves), decoded with msgspec.

Input items are one permissive Struct (``InputItem``) rather than a tagged union, since a message item may
leave out its ``type``; ``rollflow.tito.apis.responses`` checks each item's fields for its type. Unknown
fields are dropped and counted, or refused with ``agent.strict_requests``, as for Chat Completions
(``rollflow.tito.wire.decode_body``). Nothing here imports torch or transformers.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A part of an input message (``input_text``, ``output_text``, …), a reasoning item's text or summary,
    or a function call output's part."""

    type: str
    text: str | None = None
    # What the SDK sends back with an output_text part it received.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    refusal: str | None = None
    # Image and file parts: named so that they are refused by type, not dropped as unknown fields.
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None


class InputItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One input item: a message, a ``function_call``, a ``function_call_output`` or a ``reasoning`` item."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    # Set on items the proxy returned and the client sends back.
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # A ``namespace`` tool's function tools (Codex CLI groups its sub-agent tools so).
    tools: list[FunctionTool] | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A ``POST /v1/responses`` body."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    # Continue the session's own earlier response: its input and output come before ``input``.
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    top_logprobs: int | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    # Refused: server-side state and work the proxy does not keep or do.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM's extras, as for Chat Completions.
    top_k: int | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored: they do not affect sampling.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
