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


def freeze_startup_heap() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (``gc.freeze``), after a
    collection.

    A serving process (router, TITO proxy) allocates many short-lived containers per request, so collections
    are frequent, and each older-generation one walks every object the process holds: modules, a model's
    Python objects, a tokenizer. Measured on the TITO proxy over a tiny model, that was about 1 ms of GC per
    request; frozen at start-up, about 0.2 ms. Called by rollflow's own serving processes once they are set
    up, never by library code (frozen objects that later become cyclic garbage are never freed).
    """
    import gc

    gc.collect()
    gc.freeze()
