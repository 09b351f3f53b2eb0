"""Who may reach a listener: the bearer-token check of control endpoints, and a warning when a listener is
open beyond loopback without one."""

from __future__ import annotations

import hmac
import ipaddress

import structlog

log = structlog.get_logger(__name__)


def bearer_token_matches(header: str | bytes | None, token: str | bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (the scheme in any case), compared in
    constant time. aiohttp decodes header bytes that are not UTF-8 with surrogate escapes; they are encoded
    back to those bytes here, so such a header is a wrong token (401), not an encoding error (500)."""
    if not header:
        return False
    raw = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
    expected = token if isinstance(token, bytes) else token.encode("utf-8", "surrogateescape")
    scheme, _, given = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given, expected)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to bind) reaches only this machine."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(what: str, host: str, api_key: str | None) -> None:
    """Log a warning when ``what`` listens beyond loopback without an API key: its control endpoints
    (aborting every request, loading weights from any path or URL, adding workers) are then open to anyone
    who reaches the port, not only to local users."""
    if api_key or is_loopback(host):
        return
    log.warning(
        f"{what} listens on {host} without an API key: anyone who can reach it may abort every request, "
        "load weights from any path or URL, or (router) add a worker that receives prompts; set --api-key "
        "or ROLLFLOW_API_KEY (inference.api_key), or bind 127.0.0.1",
        host=host,
    )
