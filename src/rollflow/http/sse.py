"""Server-sent events as OpenAI and vLLM stream them: one ``data: <json>\\n\\n`` event per chunk, then
``data: [DONE]\\n\\n``; written by the engine server and the TITO proxy, read by the HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

SSE_DONE = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


async def iter_sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The JSON payloads of an SSE byte stream, given in chunks of any size (``aiohttp``'s
    ``response.content.iter_any()``), up to ``[DONE]``. Comments and fields other than ``data`` are skipped.

    Lines are split here rather than by ``aiohttp``'s ``readline``, which refuses lines over 128 KiB: a last
    chunk with routed experts or many logprobs can be longer.

    Raises:
        ValueError: a ``data`` field that is not JSON.
    """
    buffer = bytearray()
    async for data in chunks:
        searched = len(buffer)
        buffer += data
        while (end := buffer.find(b"\n", searched)) >= 0:
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[: end + 1]
            searched = 0
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                yield msgspec.json.decode(payload)
            except msgspec.DecodeError as error:
                raise ValueError(f"malformed SSE data: {payload[:200]!r}: {error}") from None
