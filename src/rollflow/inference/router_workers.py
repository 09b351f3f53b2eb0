"""The router's view of one inference server (``RouterWorker``: health, load, sessions), and the checks on
what a server says or is called."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec

from rollflow.errors import ENGINE_DEAD_TYPE
from rollflow.inference.vllm_errors import is_engine_core_dead


class RouterWorker:
    """One server as the router sees it; the counters feed ``/list_workers`` and ``/metrics``."""

    __slots__ = (
        "engine_dead",
        "failures",
        "healthy",
        "hung_probes",
        "last_progress",
        "outstanding",
        "requests",
        "sessions",
        "stale",
        "url",
    )

    def __init__(self, url: str):
        self.url = url
        self.healthy = True
        self.engine_dead = False  # taken out because the server said its engine died
        self.stale: str | None = None  # kept out: the policy version it serves, unlike the others'
        self.hung_probes = 0  # probes in a row that timed out with the server neither paused nor busy
        self.last_progress = 0.0  # loop time a proxied answer last began, streamed or ended
        self.outstanding = 0
        self.requests = 0
        self.failures = 0  # proxied requests that failed on the connection
        self.sessions = 0  # sessions pinned to it in the router's table, kept exact by _pin/_unpin


def validate_server_url(url: Any) -> str:
    """``http(s)://host[:port]`` without a path, normalized (no trailing slash).

    Raises:
        ValueError: anything else; the message says what is wrong.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"server URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server URL must look like http://host:port, got {url!r}")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"server URL must have no path or query (give the server's base URL), got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port outside 0-65535
    except ValueError:
        raise ValueError(f"server URL has an invalid port: {url!r}") from None
    return url.rstrip("/")


def is_engine_dead(status: int, body: bytes) -> bool:
    """Whether an answer says the server's engine died: 503 with error ``type`` ``EngineDeadError`` (rollflow's
    servers), or vLLM's 500 once its engine core died (``rollflow.inference.vllm_errors``)."""
    if status not in (500, 503) or not body:
        return False
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError, RecursionError):
        return False
    if not isinstance(error, dict):
        return False
    return error.get("type") == ENGINE_DEAD_TYPE if status == 503 else is_engine_core_dead(status, error)
