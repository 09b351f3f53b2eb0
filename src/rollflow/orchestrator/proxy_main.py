"""``rollflow proxy``'s entry point: a standalone TITO proxy over the config's ``[inference]``, with one JSON
ready line on stdout once it listens.

Admin endpoints take the bearer token from ``ROLLFLOW_ADMIN_TOKEN``, or a generated one that the ready line
prints."""

from __future__ import annotations

import os
import secrets
from typing import Any

from rollflow import eventloop
from rollflow.errors import ModelNotFoundError, RollflowError


def main(args: Any) -> int:
    """Serve the proxy ``args`` (the ``rollflow proxy`` arguments) describe; returns the exit status.

    Raises:
        ConfigError: the configs do not load.
        ModelNotFoundError: ``model.path`` cannot be resolved.
        RollflowError: the proxy could not listen on its address (the message names it).
        KeyboardInterrupt: Ctrl-C before the loop handles signals.
    """
    from rollflow.config import load_config
    from rollflow.http.runner import raise_open_file_limit
    from rollflow.orchestrator.builders import serve_proxy

    config = load_config(args.configs, args.overrides)
    token = os.environ.get("ROLLFLOW_ADMIN_TOKEN") or None
    generated = token is None
    token = token or secrets.token_urlsafe(24)

    def ready(proxy: Any) -> None:
        line = {"event": "ready", "url": proxy.base_url, "model": proxy.model_name}
        if generated:
            line["admin_token"] = token
        eventloop.announce_ready(line)  # model and tokenizer loaded

    raise_open_file_limit()
    try:
        eventloop.run(serve_proxy(config, host=args.host, port=args.port, admin_token=token, ready=ready))
    except ModelNotFoundError:
        raise  # an OSError too: not the port's fault
    except OSError as error:
        agent = config.agent
        host = args.host or (agent.host if agent is not None else "127.0.0.1")
        port = args.port if args.port is not None else (agent.port if agent is not None else 0)
        raise RollflowError(f"rollflow proxy could not listen on {host}:{port}: {error}") from error
    return 0
