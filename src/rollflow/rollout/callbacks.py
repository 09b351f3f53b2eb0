"""User callbacks (rewards, a custom task's ``item``) called under a named timeout, so that one that blocks can
neither stall a run nor keep it alive after Ctrl-C or SIGTERM.

An async callback runs on the event loop inside a cancel scope with the deadline; past it the call is
cancelled and counts as timed out, even when the callback swallowed the cancellation. An async callback that
blocks the loop itself (``time.sleep`` in an ``async def``) cannot be helped: nothing else runs meanwhile.

A sync callback runs in one of anyio's worker threads (as ``anyio.to_thread.run_sync`` always ran them), and
the event loop awaits it with ``abandon_on_cancel``: past the deadline, or when the run is cancelled (Ctrl-C,
SIGTERM, ``stop()``), the awaiting side stops waiting at once and the call is *abandoned*: its thread runs on
until the callback returns, and its result is dropped. A thread cannot be killed, so what remains is the
process's exit, which joins every non-daemon thread: ``rollflow``'s commands therefore end with ``os._exit``
(after their output is flushed) while abandoned calls are still running (``abandoned_calls``), instead of
living on until SIGKILL. Why this, and not the alternatives:

- a plain ``anyio.to_thread.run_sync`` (and ``concurrent.futures``) cannot be cancelled: a cancelled run
  waits for a blocked callback.
- daemon threads of rollflow's own would spare the exit, but move the calls off anyio's thread pool, which
  the training step shares, and that changed the quickstart's training steps on a busy 2-core machine from
  0.25 s to 0.9-1.9 s (the trainer's OpenMP threads busy-wait; ``OMP_WAIT_POLICY=PASSIVE`` undid it, so it
  is torch's threading, not the rewards, but it is the step time users would see).
- a process pool could kill a stuck call, but it needs picklable callbacks (no closures, no lambdas, no
  objects holding a client), re-imports the user's module per worker, and pays a pickle round trip per
  call; a reward is usually a few microseconds of string work, and may hold state (a judge client, a
  cache) that a process would copy.

A sync callback marked ``inline`` (``mark_inline``: rollflow's built-in rewards, a few microseconds of string
work that never blocks) is called on the event loop directly, without a thread, a timeout or a task: the
thread hand-off costs far more than such a call, once per sample (128 per quickstart step), and its Python
competes with the in-process engine's for the GIL.

An abandoned call still holds its thread and whatever it blocks on. Each ``CallbackRunner`` counts its
abandoned calls that are still running; at ``max_stuck`` it raises ``StuckCallbacksError`` instead of
starting another, which ends the run with a message that names the callback, rather than piling up a thread
per sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable
from typing import Any

import anyio

from rollflow.errors import CallbackTimeoutError, StuckCallbacksError

DEFAULT_MAX_THREADS = 16
"""Sync calls of one ``CallbackRunner`` running at once (more wait for a thread; the wait is not timed)."""
DEFAULT_MAX_STUCK = 64
"""Abandoned calls of one ``CallbackRunner`` still running past which it raises ``StuckCallbacksError``."""


INLINE_ATTRIBUTE = "rollflow_inline"


def mark_inline(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark sync ``fn`` as cheap and never blocking, so ``CallbackRunner`` calls it on the event loop (for
    rollflow's own callbacks; user callbacks keep their thread and timeout). Returns ``fn``."""
    setattr(fn, INLINE_ATTRIBUTE, True)
    return fn


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def`` function, or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    )


def is_interruption(error: BaseException) -> bool:
    """Whether ``error`` stops the run rather than failing one callback: Ctrl-C (``KeyboardInterrupt``) or a
    cancellation (the run's own, or a timeout's). Every other exception a callback raises, ``SystemExit``
    and other ``BaseException`` subclasses included, is the callback's failure."""
    return isinstance(error, KeyboardInterrupt | asyncio.CancelledError | anyio.get_cancelled_exc_class())


class _Call:
    """State of one sync call, shared by the awaiting side and its thread (under ``_LOCK``).

    A call abandoned before its thread picked it up never runs (anyio drops a job whose future was
    cancelled, and ``call`` skips one that was abandoned first), so only a started call counts as stuck.
    """

    __slots__ = ("abandoned", "counted", "finished", "started")

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.abandoned = False
        self.counted = False  # abandoned while running: counted in the stuck totals until it returns


_LOCK = threading.Lock()
_abandoned_running = 0


def abandoned_calls() -> int:
    """Sync callback calls of this process that were abandoned (timed out or cancelled) and are still
    running: the threads an exit would wait for (see the module docstring)."""
    return _abandoned_running


class CallbackRunner:
    """Calls one user callback, sync or async, under a timeout: ``await runner(*args)``.

    Returns what the callback returned. Raises ``CallbackTimeoutError`` past ``timeout_s`` (the message names
    ``name`` and ``timeout_key``), ``StuckCallbacksError`` when ``max_stuck`` abandoned calls are still
    running, and re-raises whatever the callback raised (``SystemExit`` included: see ``is_interruption``
    for what a caller should let through). Cancelling the caller stops the wait at once (see the module
    docstring for what happens to a sync call's thread).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        timeout_s: float,
        timeout_key: str,
        max_threads: int = DEFAULT_MAX_THREADS,
        max_stuck: int = DEFAULT_MAX_STUCK,
    ):
        """Args:
        fn: the callback.
        name: how messages name it (``reward 'pkg.mod:fn'``).
        timeout_s: longest one call may take, in seconds (``math.inf``: no timeout).
        timeout_key: the config key of ``timeout_s``, for messages.
        max_threads: sync calls running at once.
        max_stuck: abandoned sync calls still running at which calls fail with ``StuckCallbacksError``.
        """
        if not timeout_s > 0:
            raise ValueError(f"{timeout_key} must be > 0, got {timeout_s!r}")
        self.fn = fn
        self.name = name
        self.timeout_s = timeout_s
        self.timeout_key = timeout_key
        self.max_threads = max_threads
        self.max_stuck = max_stuck
        self.is_async = is_async_callable(fn)
        # Called on the loop, no thread or timeout (``mark_inline``); a bound method carries its function's mark.
        self.inline = not self.is_async and bool(getattr(fn, INLINE_ATTRIBUTE, False))
        self._stuck = 0  # under _LOCK
        # Per event loop (a notebook or a test suite may use the runner from more than one): the bound on
        # calls at once, and an unbounded limiter for to_thread.run_sync (whose default one the trainer
        # shares).
        self._limiters: (
            tuple[asyncio.AbstractEventLoop, anyio.CapacityLimiter, anyio.CapacityLimiter] | None
        ) = None

    @property
    def stuck(self) -> int:
        """Abandoned sync calls (past their timeout, or cancelled) whose callback has not returned yet."""
        return self._stuck

    def _timed_out(self) -> CallbackTimeoutError:
        return CallbackTimeoutError(
            f"{self.name} ran past {self.timeout_key} = {self.timeout_s:g} s", timeout_s=self.timeout_s
        )

    async def __call__(self, *args: Any) -> Any:
        if self.inline:
            return self.fn(*args)
        if self.is_async:
            with anyio.move_on_after(self.timeout_s) as scope:
                result = await self.fn(*args)
            # A deadline that fired is a timeout, even if the callback swallowed the cancellation.
            if scope.cancel_called:
                raise self._timed_out()
            return result
        return await self._call_sync(args)

    def _limiters_for_loop(self) -> tuple[anyio.CapacityLimiter, anyio.CapacityLimiter]:
        loop = asyncio.get_running_loop()
        if self._limiters is None or self._limiters[0] is not loop:
            self._limiters = (loop, anyio.CapacityLimiter(self.max_threads), anyio.CapacityLimiter(math.inf))
        return self._limiters[1], self._limiters[2]

    async def _call_sync(self, args: tuple[Any, ...]) -> Any:
        if self._stuck >= self.max_stuck:
            raise StuckCallbacksError(
                f"{self.name}: {self._stuck} of its calls ran past {self.timeout_key} = {self.timeout_s:g} s "
                "and still have not returned (each holds a thread, which cannot be killed): the callback "
                "blocks. Fix it (e.g. give its network or subprocess calls their own timeout), or raise "
                f"{self.timeout_key} if it is merely slow"
            )
        state = _Call()
        fn = self.fn

        def call() -> Any:
            global _abandoned_running
            with _LOCK:
                if state.abandoned:  # given up on before this thread picked it up: never run it
                    return None
                state.started = True
            try:
                return fn(*args)
            finally:
                with _LOCK:
                    state.finished = True
                    if state.counted:
                        self._stuck -= 1
                        _abandoned_running -= 1

        bounded, unbounded = self._limiters_for_loop()
        # The bound is taken outside the deadline: the timeout measures the callback, not the queue.
        async with bounded:
            finished = False
            try:
                with anyio.move_on_after(self.timeout_s):
                    result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=unbounded)
                    finished = True
            finally:
                if not finished:  # timed out or cancelled: stop waiting, leave the thread behind
                    self._abandon(state)
            if not finished:
                raise self._timed_out()
            return result

    def _abandon(self, state: _Call) -> None:
        global _abandoned_running
        with _LOCK:
            if state.finished:
                return
            state.abandoned = True
            if state.started:
                state.counted = True
                self._stuck += 1
                _abandoned_running += 1
