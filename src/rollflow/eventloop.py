"""Running rollflow's own processes on the fastest event loop available."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when it is installed.

    The engine server, the router and the TITO proxy spend much of each request in the loop's socket and
    HTTP handling, which uvloop does in C; on a machine whose cores are busy generating, that is CPU the
    engines get back. Without uvloop (e.g. on Windows) the standard loop runs.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
