"""User callbacks (rewards, a custom task's ``item``) called under a named timeout, so that one that blocks can
neither stall a run nor keep it alive after Ctrl-C or SIGTERM.

An async callback runs on the event loop inside a cancel scope with the deadline; past it the call is
cancelled and counts as timed out, even when the callback swallowed the cancellation. An async callback that
blocks the loop itself (``time.sleep`` in an ``async def``) cannot be helped: nothing else runs meanwhile.

A sync callback runs in a **daemon thread** of a small pool (``DaemonThreads``), and the event loop awaits a
future the thread completes. Past the deadline, or when the run is cancelled (Ctrl-C, SIGTERM, ``stop()``),
the awaiting side stops waiting at once and the thread is *abandoned*: it runs on until the callback
returns, its result is dropped, and since it is a daemon thread the interpreter does not wait for it at exit.
Why threads that can be abandoned, and not the alternatives:

- ``anyio.to_thread.run_sync`` (and ``concurrent.futures.ThreadPoolExecutor``) threads are joined: a
  cancelled run waits for a blocked callback, and the interpreter's exit joins the thread, so the process
  outlives SIGTERM until SIGKILL.
- A process pool could kill a stuck call, but it needs picklable callbacks (no closures, no lambdas, no
  objects holding a client), re-imports the user's module per worker, and pays a pickle round trip per
  call; a reward is usually a few microseconds of string work, and may hold state (a judge client, a
  cache) that a process would copy.

A thread cannot be killed, so an abandoned one still holds its stack and whatever it blocks on. Each
``CallbackRunner`` counts its abandoned calls that are still running; at ``max_stuck`` it raises
``StuckCallbacksError`` instead of starting another, which ends the run with a message that names the
callback, rather than piling up a thread per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from rollflow.errors import CallbackTimeoutError, StuckCallbacksError

DEFAULT_MAX_THREADS = 16
"""Sync calls of one ``CallbackRunner`` running at once (more wait for a thread; the wait is not timed)."""
DEFAULT_MAX_STUCK = 64
"""Abandoned calls of one ``CallbackRunner`` still running past which it raises ``StuckCallbacksError``."""


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


class _Job:
    """One sync call handed to a pool thread, and the loop future its outcome goes to."""

    __slots__ = ("abandoned", "args", "finished", "fn", "future", "loop", "on_abandoned_done")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop):
        self.fn = fn
        self.args = args
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.finished = False  # the callback returned (set under the pool's lock)
        self.abandoned = False
        # Called in the pool thread when an abandoned call finally returns.
        self.on_abandoned_done: Callable[[], None] | None = None


def _deliver(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting (timeout, cancellation)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class DaemonThreads:
    """A pool of daemon threads that runs sync callbacks; the interpreter never waits for them at exit.

    A thread is started whenever a call finds none idle (so a call starts at once: its timeout measures the
    callback, not a queue), and idle threads wait for the next call. Concurrency is bounded by the callers
    (``CallbackRunner``'s limiter), so the pool holds at most that many threads plus the abandoned ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._jobs: deque[_Job] = deque()
        self._idle = 0  # idle threads not yet reserved for a queued job
        self.threads = 0

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> _Job:
        """Start ``fn(*args)`` in a pool thread; its outcome completes the returned job's loop future."""
        job = _Job(fn, args, asyncio.get_running_loop())
        with self._lock:
            self._jobs.append(job)
            if self._idle:
                self._idle -= 1  # reserved: an idle thread takes this job
                self._wakeup.notify()
                return job
            self.threads += 1
        threading.Thread(target=self._work, name="rollflow callback", daemon=True).start()
        return job

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._wakeup.wait()
                job = self._jobs.popleft()
            self._run(job)

    def _run(self, job: _Job) -> None:
        result, error = None, None
        try:
            result = job.fn(*job.args)
        except BaseException as raised:  # SystemExit included: the caller decides what it means
            error = raised
        with self._lock:
            job.finished = True
            on_done = job.on_abandoned_done if job.abandoned else None
            self._idle += 1
        if job.abandoned:
            if on_done is not None:
                on_done()
            return
        # A closed loop (RuntimeError): nobody waits for this result any more.
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(_deliver, job.future, result, error)

    def abandon(self, job: _Job, on_done: Callable[[], None]) -> bool:
        """Stop waiting for ``job``: a queued one is dropped, a running one is left to finish, and
        ``on_done`` runs (in its thread) when it does. Returns whether it is left running."""
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
                self._idle += 1  # the thread reserved for it stays idle
                return False
            if job.finished:
                return False
            job.abandoned = True
            job.on_abandoned_done = on_done
            return True


_POOL: DaemonThreads | None = None
_POOL_LOCK = threading.Lock()


def daemon_threads() -> DaemonThreads:
    """The process's pool of callback threads (created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = DaemonThreads()
        return _POOL


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
        self._stuck = 0
        self._stuck_lock = threading.Lock()
        # Per event loop: a notebook or a test suite may use the runner from more than one.
        self._limiter: tuple[asyncio.AbstractEventLoop, anyio.CapacityLimiter] | None = None

    @property
    def stuck(self) -> int:
        """Abandoned sync calls (past their timeout, or cancelled) whose callback has not returned yet."""
        return self._stuck

    def _timed_out(self) -> CallbackTimeoutError:
        return CallbackTimeoutError(
            f"{self.name} ran past {self.timeout_key} = {self.timeout_s:g} s", timeout_s=self.timeout_s
        )

    async def __call__(self, *args: Any) -> Any:
        if self.is_async:
            with anyio.move_on_after(self.timeout_s) as scope:
                result = await self.fn(*args)
            # A deadline that fired is a timeout, even if the callback swallowed the cancellation.
            if scope.cancel_called:
                raise self._timed_out()
            return result
        return await self._call_sync(args)

    def _limiter_for_loop(self) -> anyio.CapacityLimiter:
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, anyio.CapacityLimiter(self.max_threads))
        return self._limiter[1]

    def _abandoned_done(self) -> None:
        with self._stuck_lock:
            self._stuck -= 1

    async def _call_sync(self, args: tuple[Any, ...]) -> Any:
        if self._stuck >= self.max_stuck:
            raise StuckCallbacksError(
                f"{self.name}: {self._stuck} of its calls ran past {self.timeout_key} = {self.timeout_s:g} s "
                "and still have not returned (each holds a thread, which cannot be killed): the callback "
                "blocks. Fix it (e.g. give its network or subprocess calls their own timeout), or raise "
                f"{self.timeout_key} if it is merely slow"
            )
        pool = daemon_threads()
        async with self._limiter_for_loop():
            job = pool.submit(self.fn, args)
            finished = False
            try:
                with anyio.move_on_after(self.timeout_s):
                    result = await job.future
                    finished = True
            finally:
                if not finished:  # timed out or cancelled: stop waiting, leave the thread behind
                    with self._stuck_lock:
                        if pool.abandon(job, self._abandoned_done):
                            self._stuck += 1
            if not finished:
                raise self._timed_out()
            return result
