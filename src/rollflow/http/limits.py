"""``HttpLimits``: what rollflow's HTTP listeners tolerate from slow clients (enforced in
``rollflow.http.runner``), and the limits a parsed command line's ``--http-*`` flags ask for
(``limits_from_flags``; ``rollflow.launch.server_group.http_limit_flags`` writes them). Apart so that the
command line can show the defaults without importing aiohttp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one rollflow HTTP listener tolerates from its clients (``rollflow.http.runner`` says how each
    limit is enforced; the config keys are ``inference.http_header_timeout_s``, ``inference.http_body_timeout_s``
    and ``inference.http_max_connections``, the flags ``--http-header-timeout-s`` … of ``serve`` and ``router``).

    The defaults suit loopback and datacenter clients: a header takes milliseconds, and a body of the
    largest size servers accept (32 MiB) arrives within ``body_timeout_s`` at a quarter of a MB/s.
    """

    # Seconds to send the request line and headers, from the connection opening or the previous response;
    # also how long an idle kept-alive connection stays open.
    header_timeout_s: float = 30.0
    # Seconds to send the whole body once the headers are in.
    body_timeout_s: float = 120.0
    # Connections served at once; further ones get 503 and are closed.
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not value > 0:  # also NaN
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_connections, bool) or not (
            isinstance(self.max_connections, int) and self.max_connections >= 1
        ):
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")


def limits_from_flags(args: Any) -> HttpLimits:
    """The ``HttpLimits`` the parsed ``--http-*`` flags (an ``argparse.Namespace``) ask for."""
    return HttpLimits(
        header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s,
        max_connections=args.http_max_connections,
    )


__all__ = ["HttpLimits", "limits_from_flags"]
