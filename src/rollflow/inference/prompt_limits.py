"""Cheap length checks that refuse oversized text prompts before they are tokenized, and the size above
which tokenizing or rendering moves off the event loop.

A text prompt of ``C`` characters tokenizes to at least ``C / (max_token_chars * NORMALIZATION_SLACK)``
tokens, where ``max_token_chars`` is the longest entry of the tokenizer's vocabulary (added tokens
included): every token covers at most that many characters of the normalized text (byte-level BPE vocab
entries spell one character per byte, SentencePiece entries spell their text, byte-fallback entries such as
``<0x0A>`` are longer than the one byte they cover). Unicode normalization may shrink the text before that;
composition merges at most four code points into one (Greek letter + three marks, e.g. U+1FAF), hence
``NORMALIZATION_SLACK``. (Normalizers that delete characters, such as BERT's control-character cleanup
or whitespace stripping, would break the bound; causal LMs' tokenizers have none, byte-level BPE never drops
a byte.) So a prompt with more than ``max_prompt_chars(max_model_len, tokenizer)``
characters cannot fit ``max_model_len`` tokens, and is refused without tokenizing it: a 30 MB prompt costs
a length check, not seconds of event-loop time and gigabytes of token offsets.

Imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Unicode composition maps at most 4 code points to 1 (see the module docstring).
NORMALIZATION_SLACK = 4
# Text (characters) above this is tokenized or rendered in a worker thread: below it, encoding takes well
# under a millisecond and a thread hop would cost more than it saves.
OFFLOAD_CHARS = 32 * 1024


def max_token_chars(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry spells (at least 1); 1024 when the vocabulary is unknown."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 1024
    try:
        return max((len(token) for token in get_vocab()), default=1) or 1
    except Exception:  # an exotic tokenizer: fall back to a bound no real vocabulary reaches
        return 1024


def max_prompt_chars(max_model_len: int, tokenizer: Any) -> int:
    """Characters above which a text prompt cannot fit ``max_model_len`` tokens (see the module docstring)."""
    return max_model_len * max_token_chars(tokenizer) * NORMALIZATION_SLACK


def message_text_chars(messages: Any) -> int:
    """Characters of the system, user and tool message contents of a chat request (text parts included).

    Chat templates render those verbatim, so they bound the rendered prompt from below; assistant contents
    are left out because templates may drop parts of them (earlier turns' reasoning).
    """
    total = 0
    if not isinstance(messages, list):
        return 0
    for message in messages:
        if isinstance(message, dict):
            role, content = message.get("role"), message.get("content")
        else:  # a wire Struct
            role, content = getattr(message, "role", None), getattr(message, "content", None)
        if role == "assistant":
            continue
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
                if isinstance(text, str):
                    total += len(text)
    return total


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def _json_chars(value: Any) -> int:
    """Characters ``value`` takes as text: a string's length, anything else's JSON (templates ``tojson`` it)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    try:
        return len(msgspec.json.encode(value))  # C speed: milliseconds for megabytes
    except (TypeError, ValueError, OverflowError):
        return len(str(value))


def rendered_chars(messages: Any, tools: Any = None) -> int:
    """Characters of everything of a chat request a template may render: every message's content (all
    roles, text parts included), reasoning, tool calls' names and arguments, and the tool definitions.

    The size that decides whether rendering moves off the event loop (``OFFLOAD_CHARS``); an upper estimate
    of the rendered text, not the refusal bound (``message_text_chars``): templates may drop parts of it.
    """
    total = _json_chars(tools) if tools else 0
    if not isinstance(messages, list):
        return total
    for message in messages:
        content = _field(message, "content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = _field(part, "text")
                if isinstance(text, str):
                    total += len(text)
        for name in ("reasoning_content", "reasoning"):
            reasoning = _field(message, name)
            if isinstance(reasoning, str):
                total += len(reasoning)
        tool_calls = _field(message, "tool_calls")
        if isinstance(tool_calls, list):
            for call in tool_calls:
                function = _field(call, "function")
                if function is None:
                    total += _json_chars(call)
                else:
                    total += _json_chars(_field(function, "name")) + _json_chars(
                        _field(function, "arguments")
                    )
    return total


def prompt_too_long_message(chars: int, limit: int, max_model_len: int) -> str:
    """The 400 message for a prompt refused by its character count."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {chars} "
        f"characters, more than the {limit} that could fit in it (max_model_len x the longest token's "
        "characters x 4), so it was not tokenized. Please reduce the length of the prompt."
    )


__all__ = [
    "NORMALIZATION_SLACK",
    "OFFLOAD_CHARS",
    "max_prompt_chars",
    "max_token_chars",
    "message_text_chars",
    "prompt_too_long_message",
    "rendered_chars",
]
