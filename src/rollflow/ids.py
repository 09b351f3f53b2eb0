"""Unique ids made without a system call each, for ids a serving path makes per request.

``secrets`` and ``uuid.uuid4`` read the operating system's random source on every call; the TITO proxy makes
two ids per turn. An id here is a random per-process prefix (64 bits from ``secrets``, drawn again in a forked
child) followed by a counter: unique within the process by the counter, and across processes and hosts unless
two processes draw the same prefix (a chance of about n²/2⁶⁵ among n processes, as for random ids of that
size). These ids are sequential and so guessable from one another: never use them as credentials.
"""

from __future__ import annotations

import itertools
import os
import secrets

_prefix = secrets.token_hex(8)
_counter = itertools.count()


def _draw_prefix() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(8)
    _counter = itertools.count()


# A forked child would otherwise repeat its parent's ids.
os.register_at_fork(after_in_child=_draw_prefix)


def unique_hex() -> str:
    """An id unique to this call: 24 lowercase hex digits (more after 2³² ids in one process), thread-safe."""
    return f"{_prefix}{next(_counter):08x}"
