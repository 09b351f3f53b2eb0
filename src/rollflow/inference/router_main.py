"""``rollflow router``'s entry point: an ``InferenceRouter`` built from the parsed command line, served until
SIGTERM or SIGINT, with one JSON ready line on stdout once it listens (what ``RouterProcess`` waits for)."""

from __future__ import annotations

from typing import Any

from rollflow import eventloop
from rollflow.config import api_key_or_env
from rollflow.errors import ConfigError
from rollflow.http.limits import limits_from_flags


def main(args: Any) -> int:
    """Serve the router ``args`` (the ``rollflow router`` flags) describe; returns the exit status.

    Raises:
        ConfigError: flags the router refuses (e.g. no ``--server``).
        OSError: the address cannot be bound.
        KeyboardInterrupt: Ctrl-C before the loop handles signals.
    """
    from rollflow.http.runner import raise_open_file_limit
    from rollflow.inference.router import InferenceRouter, serve_router

    try:
        router = InferenceRouter(
            args.servers,
            host=args.host,
            port=args.port,
            health_check_interval_s=args.health_check_interval_s,
            request_timeout_s=args.request_timeout_s,
            balance_factor=args.balance_factor,
            api_key=api_key_or_env(args.api_key),
            http_limits=limits_from_flags(args),
            max_request_sequences=args.max_request_sequences,
        )
    except ValueError as error:
        raise ConfigError(f"rollflow router: {error}") from None

    def ready(url: str) -> None:
        eventloop.announce_ready({"event": "ready", "url": url})

    raise_open_file_limit()
    eventloop.run(serve_router(router, ready))
    return 0
