"""The UTF-8 bytes a single token stands for, as OpenAI's logprob ``bytes`` field means them.

Decoding one token alone gives U+FFFD where the token is only part of a character (byte-level BPE splits
multi-byte characters; SentencePiece has ``<0xNN>`` byte-fallback tokens), so ``text.encode()`` would report
U+FFFD's three bytes instead of the token's own. ``token_bytes`` maps such a token's vocabulary entry back
to its bytes: ``<0xNN>`` is byte NN; a byte-level BPE entry spells one byte per character (GPT-2's
``bytes_to_unicode`` table). Any other token is its decoded text's bytes.

Imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd"


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: vocabulary character -> the byte it spells."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = printable[:]
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + shifted)
            shifted += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The bytes of token ``token_id``, whose text decoded alone is ``text``."""
    if _REPLACEMENT not in text:
        return list(text.encode())
    try:
        entry = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # an exotic tokenizer: the text is the best there is
        entry = None
    if isinstance(entry, str):
        fallback = _BYTE_FALLBACK.fullmatch(entry)
        if fallback is not None:
            return [int(fallback.group(1), 16)]
        alphabet = _byte_level_alphabet()
        if entry and all(char in alphabet for char in entry):
            return [alphabet[char] for char in entry]
    return list(text.encode())


__all__ = ["token_bytes"]
