"""Completion text without special tokens: what a reward or an agent should see.

``renderers``' parsers strip the framing tokens they know; the generic (chat-template) renderer strips only the
tokenizer's ``all_special_tokens``, which in transformers 5 are the named ones (eos, pad). Added special tokens
(Qwen's ``<|im_start|>``) then stayed in the content, where decoding with ``skip_special_tokens`` (vLLM's output
text, TRL's completions) drops them. Pure Python: no torch or transformers import.
"""

from __future__ import annotations

from typing import Any

# Reasoning markers the renderers split on; content may quote them literally, so they are never stripped.
_REASONING_MARKERS = frozenset({"<think>", "</think>"})


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every token that decoding with ``skip_special_tokens=True`` drops (the tokenizer's named
    special tokens and every added token marked special), longest first, without the reasoning markers.

    ``renderers``' generic renderer strips only ``all_special_tokens``, which in transformers 5 holds the
    named ones (eos, pad): an added special token such as Qwen's ``<|im_start|>`` stayed in the content.
    """
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(getattr(added, "content", str(added)))
    return tuple(sorted((t for t in texts if t and t not in _REASONING_MARKERS), key=len, reverse=True))


def strip_special_texts(text: str, special_texts: tuple[str, ...]) -> str:
    """``text`` without any of ``special_texts`` (``special_token_texts``): the answer a reward should see,
    as vLLM's output text and TRL's completions have it."""
    for special in special_texts:
        if special in text:
            text = text.replace(special, "")
    return text
