"""``rollflow serve``'s process entry point: load the model, serve it until SIGTERM or SIGINT, shut down."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import structlog

from rollflow import eventloop
from rollflow.errors import ModelNotFoundError, RollflowError
from rollflow.http.auth import warn_if_exposed
from rollflow.http.limits import HttpLimits, limits_from_flags
from rollflow.http.runner import raise_open_file_limit
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.request_limits import RequestLimits

log = structlog.get_logger("rollflow.inference.engine.server")


async def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int = 64,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    return_routed_experts: bool = False,
    http_limits: HttpLimits | None = None,
    device: str = "auto",
    logprobs_mode: str = "processed_logprobs",
    adapter_versions: int = 0,
    ready: Callable[[dict[str, Any]], None] | None = None,
    request_limits: RequestLimits | None = None,
    max_request_share: float | None = None,
) -> None:
    """Load the model, serve it until SIGTERM or SIGINT, then shut down cleanly.

    Once listening, calls ``ready`` with ``{"event": "ready", "url", "host", "port", "model"}``. Bound to an
    address other than loopback without an ``api_key``, it logs a warning: every endpoint is then open to
    whoever reaches the port (aborting everyone's requests, loading weights from any path or URL).

    Raises:
        ModelNotFoundError: the model cannot be resolved or its files cannot be read.
        EngineError, ValueError: as ``EngineServer.from_model``.
        OSError: the address cannot be bound.
    """
    try:
        server = await asyncio.to_thread(
            EngineServer.from_model,
            model,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            served_model_name=served_model_name,
            api_key=api_key,
            return_routed_experts=return_routed_experts,
            http_limits=http_limits,
            device=device,
            logprobs_mode=logprobs_mode,
            adapter_versions=adapter_versions,
            request_limits=request_limits,
            max_request_share=max_request_share,
        )
    except RollflowError:
        raise
    except OSError as error:  # unreadable model files: the model's fault, not the address's
        raise ModelNotFoundError(f"could not load model {model!r}: {error}") from error
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        url = await server.start(host, port)
        bound_port = int(url.rsplit(":", 1)[1])
        log.info("serving", url=url, model=server.served_model_name)
        warn_if_exposed("rollflow serve", host, api_key)
        if ready is not None:
            ready(
                {
                    "event": "ready",
                    "url": url,
                    "host": host,
                    "port": bound_port,
                    "model": server.served_model_name,
                }
            )
        await stop.wait()
        log.info("shutting down", url=url)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await server.close()


def main(args: Any) -> int:
    """``rollflow serve``: prints one JSON ready line on stdout once listening; returns the exit status."""

    from rollflow.config import api_key_or_env

    raise_open_file_limit()
    eventloop.run(
        serve(
            args.model,
            host=args.host,
            port=args.port,
            max_batch_size=args.max_batch_size,
            max_model_len=args.max_model_len,
            served_model_name=args.served_model_name,
            api_key=api_key_or_env(args.api_key),
            return_routed_experts=args.return_routed_experts,
            http_limits=limits_from_flags(args),
            device=args.device,
            logprobs_mode=args.logprobs_mode,
            adapter_versions=args.adapter_versions,
            ready=eventloop.announce_ready,  # model loaded
            request_limits=RequestLimits(
                max_sequences=args.max_request_sequences, max_tokens=args.max_request_tokens
            ),
            max_request_share=args.max_request_share,
        )
    )
    return 0


__all__ = ["main", "serve"]
