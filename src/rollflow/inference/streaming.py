"""Server-sent events and incremental text, shared by the engine server, the HTTP client and the TITO proxy.

SSE as OpenAI and vLLM stream it: one ``data: <json>\\n\\n`` event per chunk, then ``data: [DONE]\\n\\n``.

Streamed text is never decoded token by token: a byte-level BPE token may hold half of a UTF-8 character, and
parsers (reasoning, tool calls) may change how earlier text reads. So the whole output so far is decoded (or
parsed) each time and only its new suffix is sent, once stable (``TextDeltas``). No torch here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

SSE_DONE = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()
# What a decoder shows for an incomplete UTF-8 sequence at the end of the tokens so far.
_REPLACEMENT = "\ufffd"


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


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


async def iter_sse(lines: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The JSON payloads of an SSE byte stream, given line by line (``aiohttp``'s ``response.content``),
    up to ``[DONE]``. Comments and fields other than ``data`` are skipped.

    Raises:
        ValueError: a ``data`` field that is not JSON.
    """
    async for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield msgspec.json.decode(data)
        except msgspec.DecodeError as error:
            raise ValueError(f"malformed SSE data: {data[:200]!r}: {error}") from None
