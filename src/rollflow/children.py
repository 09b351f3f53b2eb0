"""How rollflow starts its Python child processes (the trainer process, trainer workers).

Children start from a fork server (``multiprocessing``'s ``forkserver``) that has imported torch and
transformers once: a fresh interpreter that imports them takes seconds, a fork of the server a few
milliseconds. The server is a clean process started for this purpose (no threads of the parent, no CUDA
context), so forking it is as safe as ``spawn``; this is why the parent is never forked itself.

A fork server keeps the environment it started with, so each child takes the parent's environment as it
is when the child starts (``CUDA_VISIBLE_DEVICES`` set just before a worker group starts reaches it).
Where ``forkserver`` is not available (Windows), children are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

# Imported once by the fork server, so its children start with them. A module that fails to import is
# skipped by multiprocessing (the child then imports what it needs itself).
PRELOAD = ["torch", "transformers", "rollflow.train.trainer"]

_preload_set = False


def process_context() -> Any:
    """The multiprocessing context child processes are started from (see the module docstring)."""
    global _preload_set
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    if not _preload_set:
        # Effective only before the fork server starts (it starts on the first child).
        multiprocessing.set_forkserver_preload(PRELOAD)
        _preload_set = True
    return multiprocessing.get_context("forkserver")


def start_child(target: Callable[..., Any], args: tuple[Any, ...], *, name: str) -> Any:
    """Start ``target(*args)`` in a daemon child process with this process's current environment; return
    the ``multiprocessing.Process``."""
    context = process_context()
    process = context.Process(
        target=_in_environment, args=(dict(os.environ), target, args), name=name, daemon=True
    )
    process.start()
    return process


def _in_environment(environ: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``target`` in the parent's environment (a fork server's children inherit the server's)."""
    os.environ.clear()
    os.environ.update(environ)
    return target(*args)
