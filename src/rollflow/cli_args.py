"""Argument types and shared flag groups of ``rollflow``'s command line: each bad value is a usage error that
names the flag (argparse adds it) and says what it takes."""

from __future__ import annotations

import argparse


def port(text: str) -> int:
    """``--port``: 0-65535 (0 picks a free port); anything else is a usage error naming the flag."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; use 0-65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number; use 0-65535 (0 picks a free port)")
    return port


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def balance_factor(text: str) -> float:
    """``rollflow router --balance-factor``: a finite number >= 1.0 (``validate_balance_factor``)."""
    from rollflow.inference.router import validate_balance_factor

    try:
        return validate_balance_factor(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a valid balance factor; use a finite number >= 1.0 (1.0: servers differ by "
            "at most one session; larger: closer to plain consistent hashing)"
        ) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def add_http_limits(parser: argparse.ArgumentParser) -> None:
    """Flags of ``rollflow.http.limits.HttpLimits`` (the config keys ``inference.http_*``)."""
    from rollflow.http.limits import HttpLimits

    defaults = HttpLimits()
    parser.add_argument(
        "--http-header-timeout-s",
        type=positive_float,
        default=defaults.header_timeout_s,
        help="seconds a client has to send a request's line and headers; idle kept-alive connections are "
        f"closed after as long (default {defaults.header_timeout_s:g})",
    )
    parser.add_argument(
        "--http-body-timeout-s",
        type=positive_float,
        default=defaults.body_timeout_s,
        help=f"seconds a client has to send a request's body (default {defaults.body_timeout_s:g})",
    )
    parser.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=defaults.max_connections,
        help=f"connections served at once; more get 503 (default {defaults.max_connections})",
    )
