"""Waits on conditions, never on time: a test that needs something asynchronous to have happened waits until
it has, within a generous deadline (the suite runs on a loaded 2-core machine), and fails naming what it
waited for. A fixed sleep before an assertion is a guess at how fast the machine is."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

DEADLINE_S = 60.0


async def wait_until(
    condition: Callable[[], Any],
    what: str | Callable[[], str],
    timeout_s: float = DEADLINE_S,
    poll_s: float = 0.005,
) -> Any:
    """Return ``condition()``'s first true value, polling every ``poll_s``; ``condition`` may be a coroutine
    function (``await``-ed each time). Raises TimeoutError naming ``what`` after ``timeout_s`` (a callable
    ``what`` is called then, to say what the state was)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(_failure(what, timeout_s))
        await asyncio.sleep(poll_s)


def wait_until_sync(
    condition: Callable[[], Any],
    what: str | Callable[[], str],
    timeout_s: float = DEADLINE_S,
    poll_s: float = 0.05,
) -> Any:
    """``wait_until`` for code without an event loop (a thread, a plain test): blocks while it polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(_failure(what, timeout_s))
        time.sleep(poll_s)
    return value


def _failure(what: str | Callable[[], str], timeout_s: float) -> str:
    return f"not within {timeout_s:g} s: {what() if callable(what) else what}"
