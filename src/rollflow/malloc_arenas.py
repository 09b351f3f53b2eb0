"""Fewer glibc malloc arenas for rollflow's processes: the cause of most of a CPU run's resident memory.

glibc gives each thread that allocates under contention its own arena, up to 8 per core. A run's threads (the
event loop, the engine's worker, the training step's worker thread, torch's pools) allocate and free tensors in
turn, and each arena keeps the pages freed in it, so the quickstart on 2 cores peaked at 1.6 GiB of RSS with
the default against about 0.7 GiB with ``MALLOC_ARENA_MAX=1`` or ``2``, with the same rewards and the same CPU
time (``benchmarks/memory.py``).

``limit_malloc_arenas`` sets the limit for this process (``mallopt(M_ARENA_MAX)``, which binds arenas created
after it: the CLI calls it first thing, before threads exist) and in the environment, so the children it
spawns (trainer processes, engine servers) start with it. A ``MALLOC_ARENA_MAX`` already in the environment is
the user's choice and is left as it is; on a C library without ``mallopt`` (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import os

# The limit the CLI applies: 2 measured as low as 1, and keeps a second arena for the worker threads.
DEFAULT_MAX_ARENAS = 2
# glibc's malloc.h: #define M_ARENA_MAX -8
_M_ARENA_MAX = -8


def limit_malloc_arenas(max_arenas: int = DEFAULT_MAX_ARENAS) -> int | None:
    """Limit glibc's malloc arenas to ``max_arenas`` here and in children spawned from now on, unless
    ``MALLOC_ARENA_MAX`` is set already; returns the limit applied, or None when nothing was changed."""
    if max_arenas < 1:
        raise ValueError(f"max_arenas must be >= 1, got {max_arenas}")
    if os.environ.get("MALLOC_ARENA_MAX"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 — only glibc has it, and only glibc reads MALLOC_ARENA_MAX
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if mallopt(_M_ARENA_MAX, max_arenas) != 1:  # mallopt returns 1 on success
        return None
    os.environ["MALLOC_ARENA_MAX"] = str(max_arenas)
    return max_arenas
