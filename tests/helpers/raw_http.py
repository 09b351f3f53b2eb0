"""Raw HTTP/1.1 over a kept-alive loopback connection, for tests of what a listener does byte for byte."""

from __future__ import annotations

import asyncio
import json


async def exchange(reader, writer, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` and read one response (Content-Length or chunked) from the kept-alive connection."""
    writer.write(raw)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers["content-length"]))


def raw_post(path: str, body: dict | bytes, *, extra: bytes = b"", chunked: bool = False) -> bytes:
    """A raw POST of ``body`` (a dict as JSON, bytes as they are); ``extra``: more header lines. ``chunked``
    sends it with chunked transfer coding, which a listener's front never serves (so aiohttp answers: the
    reference the front's answers are compared with)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = b"POST %s HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n" % path.encode() + extra
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    return head + b"Content-Length: %d\r\n\r\n" % len(data) + data
