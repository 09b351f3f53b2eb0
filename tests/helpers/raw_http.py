"""Raw HTTP/1.1 over a kept-alive loopback connection, for tests of what a listener does byte for byte."""

from __future__ import annotations

import asyncio


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
