"""The loop a trainer child process runs: the trainer process's (``rollflow.train.process``) and each trainer
worker rank's (``rollflow.train.workers``).

The parent sends ``(method, *args)`` tuples over a pipe; the child answers each with ``("ok", value, "")`` or
``("error", exception, traceback)``, in order, until ``("close",)`` or until the pipe closes (the parent is
gone). Building the trainer is answered the same way, once, before the first call.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from rollflow.errors import RollflowError

Reply = tuple[str, Any, str]
T = TypeVar("T")


def serve_trainer_calls(
    conn: Connection,
    build: Callable[[], T],
    answer: Callable[[T, str, list[Any]], Any],
    *,
    stand_in: type[RollflowError],
    on_close: Callable[[], None] | None = None,
) -> None:
    """Build the trainer (``build()``), report it ready, then answer calls (``answer(trainer, method, args)``)
    until ``close`` (after which ``on_close`` runs, if given) or until the parent's end of the pipe closes.

    An exception raised by ``build`` or ``answer`` is sent back (see ``error_reply``; ``stand_in`` for one that
    does not pickle) instead of ending the loop.
    """
    # Ctrl-C in a terminal, and SIGTERM from `timeout`, systemd or Slurm, reach the whole process group; the
    # parent finishes the call in progress (a checkpoint-safe stop) and then decides when the trainer ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        trainer = build()
    except Exception as error:
        conn.send(error_reply(error, stand_in))
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            method, *args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if method == "close":
            if on_close is not None:
                on_close()
            return
        try:
            reply: Reply = ("ok", answer(trainer, method, args), "")
        except Exception as error:
            reply = error_reply(error, stand_in)
        try:
            conn.send(reply)
        except OSError:
            return  # the parent is gone


def error_reply(error: Exception, stand_in: type[RollflowError]) -> Reply:
    """A child's reply for ``error``: the exception itself when it pickles (so the parent raises the same
    type), else a ``stand_in`` naming it; with the child's traceback."""
    import pickle

    details = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = stand_in(f"{type(error).__name__}: {error}")
    return ("error", error, details)
