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


# Allocations (less deallocations) of tracked objects between two young-generation collections of a serving
# process; the interpreter's default is 700.
SERVING_GEN0_THRESHOLD = 50_000


def tune_gc_for_serving() -> None:
    """Set a serving process's cyclic garbage collector up for many short requests: move every object alive now
    out of its reach (``gc.freeze``, after a collection), and collect the young generation every
    ``SERVING_GEN0_THRESHOLD`` allocations instead of every 700.

    A serving process (engine server, router, TITO proxy) allocates many short-lived containers per request, so
    collections are frequent, and each older-generation one walks every object the process holds: modules, a
    model's Python objects, a tokenizer. Measured on the TITO proxy over a tiny model, that was about 1 ms of GC
    per request; frozen at start-up, about 0.2 ms. With the default threshold the young generation is still
    collected every few requests, promoting the objects of requests in flight, which older collections then
    walk again; ``benchmarks/tito_load.py`` read 35 us of GC per proxied request at 700 and about 6 us at 50,000
    (the containers of one request, freed by reference counting, mostly never meet a collection). Called by
    rollflow's own serving processes once they are set up, never by library code (frozen objects that later
    become cyclic garbage are never freed).
    """
    import gc

    gc.collect()
    gc.freeze()
    _, *older = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, *older)


def announce_ready(event: dict[str, object]) -> None:
    """A serving process is set up: tune its garbage collector (``tune_gc_for_serving``), then write ``event``
    as one JSON line on stdout: the line the process that started it waits for."""
    import json
    import sys

    tune_gc_for_serving()
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()
