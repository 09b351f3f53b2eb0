"""Incremental text for streamed replies, shared by the engine server and the TITO proxy.

Streamed text is never decoded token by token: a byte-level BPE token may hold half of a UTF-8 character, and
parsers (reasoning, tool calls) may change how earlier text reads. Parsed replies are parsed whole each time
and only their new, stable suffix is sent (``TextDeltas``); plain text decodes a short window of the last
tokens (``IncrementalDecoder``). Both check at the end that what they sent adds up to the final text. No torch.
"""

from __future__ import annotations

from collections.abc import Callable

# What a decoder shows for an incomplete UTF-8 sequence at the end of the tokens so far.
_REPLACEMENT = "\ufffd"


class TextDeltas:
    """The new, stable part of a growing text, so that the parts sent add up to the final text.

    ``update(text)`` takes the whole text so far and returns what to send now: the part after what was sent
    before, without a trailing replacement character (a character whose bytes have not all been sampled yet)
    and, with ``strip``, without leading and trailing whitespace (for parsed replies: parsers strip the final
    text, while a reply cut short may not be stripped yet, e.g. an open reasoning block).
    ``update(text, final=True)`` sends the rest, as given. A text that stops extending what
    was already sent (a parser re-read earlier text) sends nothing more until it extends it again; ``diverged``
    then tells that the parts sent do not add up to the final text.
    """

    def __init__(self, *, strip: bool = False):
        self.strip = strip
        self.sent = ""
        self.diverged = False

    def update(self, text: str, *, final: bool = False) -> str:
        if not final:
            text = text.rstrip(_REPLACEMENT)
            if self.strip:
                text = text.strip()
        if not text.startswith(self.sent):
            if final:
                self.diverged = True
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta


class IncrementalDecoder:
    """Plain text of a growing list of token ids, one stable delta at a time, decoding only the tokens since
    the last delta (and the few before them, so that a tokenizer sees the context of a word's start).

    Each ``update`` costs a decode of a few tokens, not of the whole output; ``finish`` decodes the whole
    output once and sends the rest, so the deltas add up to ``decode(token_ids)`` (``diverged`` tells when
    they could not: a tokenizer whose text of a window differs from its share of the whole text).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = TextDeltas()
        self._prefix_offset = 0  # tokens before this were sent and are not decoded again
        self._read_offset = 0  # tokens before this were sent

    @property
    def diverged(self) -> bool:
        return self.text.diverged

    def update(self, token_ids: list[int]) -> str:
        prefix = self.decode(token_ids[self._prefix_offset : self._read_offset])
        window = self.decode(token_ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT) or not window.startswith(prefix):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self.text.update(self.text.sent + window[len(prefix) :])

    def finish(self, token_ids: list[int]) -> str:
        return self.text.update(self.decode(token_ids), final=True)
