"""One JSON POST over a fresh aiohttp session, for tests that check a listener's status and error body."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


async def post_json(
    url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST ``body`` (a dict sent as JSON, or raw bytes as they are) and answer ``(status, decoded JSON)``.

    Bytes go out untouched so tests can send malformed JSON; the content type is JSON either way.
    """
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as http, http.post(url, data=data, headers=headers) as response:
        return response.status, await response.json(content_type=None)
