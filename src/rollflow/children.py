"""How rollflow starts its Python child processes (the trainer process, trainer workers): spawned, never
forked, since the parent may hold threads (the event loop's executor, torch's pools) that a fork would copy
mid-operation. Each child runs with the parent's environment as it is when the child starts.

A fork server that imports torch once would start children in milliseconds instead of seconds; it was
tried and set aside: late in a long test session, children forked from it exited during weight pushes
without a traceback reaching the parent (their output goes to the server's streams, not the parent's).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def start_child(target: Callable[..., Any], args: tuple[Any, ...], *, name: str) -> Any:
    """Start ``target(*args)`` in a spawned daemon child process; return the ``multiprocessing.Process``."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
    process.start()
    return process
