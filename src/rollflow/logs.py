"""Logging for rollflow's processes: configured once per process, by its entry point (the ``rollflow`` CLI, a
proxy worker); library modules only call ``structlog.get_logger(__name__)``."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to ``sys.stderr`` as it is at each line, not as it was when logging was configured: a notebook
    or a test harness may swap (and close) the stream in between."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str, *, cache: bool = True) -> None:
    """Console rendering on a terminal, one JSON object per line otherwise; both on stderr. ``cache``: each
    logger keeps this configuration from its first use on (cheaper; a process that reconfigures structlog
    later, such as a test suite, passes False)."""
    renderer = (
        structlog.dev.ConsoleRenderer(colors=True)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=cache,
    )
