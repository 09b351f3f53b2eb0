"""The TITO proxy in worker processes: agents' HTTP, rendering, parsing and traces off the run's interpreter.

A ``TITOProxy`` runs on its owner's event loop. When the engines run in that same process (rollflow's torch
engine, ``inference.mode = "local"``), every proxied turn's HTTP handling, rendering and parsing competes with
the engine's own Python for one interpreter lock. ``ProxyWorkers`` moves all of that into worker processes
(``agent.proxy_workers``): each runs a whole ``TITOProxy`` on its own port and owns the sessions opened on it,
so a session's turns keep the order its trace actor gives them. The run's process keeps the inference client
and only answers generate calls (token ids in, token ids out) over a socket pair per worker; a closed session's
trace comes back pickled, for the composer.

The link carries ``rollflow.messages.Worker*`` Structs as length-prefixed msgpack frames. A worker whose
process dies takes its open sessions with it (their traces come back empty with the error, which masks the
trajectories); the next session goes to a live worker, or to a fresh one started in its place.

Streamed requests stream across the link too (``WorkerStream``, ``WorkerChunk``) when the run's client
streams; a caller that leaves (an agent that disconnects, a stop string that completes) cancels the run's call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import pickle
import socket
import struct
import sys
from typing import Any

import msgspec
import structlog

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InferenceError,
    InferenceUnavailableError,
    RollflowError,
)
from rollflow.messages import (
    GenerateRequest,
    WorkerCancel,
    WorkerChunk,
    WorkerClose,
    WorkerClosed,
    WorkerFailure,
    WorkerGenerate,
    WorkerMessage,
    WorkerOpen,
    WorkerOpened,
    WorkerOutput,
    WorkerReady,
    WorkerSetup,
    WorkerStream,
)
from rollflow.processes import CommandChild, start_command
from rollflow.tito.proxy import DEFAULT_MAX_SESSIONS, claim_session_id, remember_closed, too_many_sessions
from rollflow.tito.renderer import TITORenderer
from rollflow.tito.trace import Trace

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">I")
_NUMPY_EXT = 1  # msgpack extension code of a pickled numpy array (routed experts)


class ProxyWorkerError(RollflowError):
    """A proxy worker process did not start, or exited; the message says which and how."""


# ---------------------------------------------------------------------------------------------- the link


def _enc_hook(value: Any) -> Any:
    if hasattr(value, "__array__"):  # routed experts: a numpy array, between two processes of this run
        return msgspec.msgpack.Ext(_NUMPY_EXT, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    raise NotImplementedError(f"cannot send {type(value).__name__} to a proxy worker")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NUMPY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    return pickle.loads(data)


class Link:
    """One end of the socket pair between the run and a worker: ``send`` frames a message (without waiting:
    frames are small and bounded by the requests in flight), ``receive`` returns the next one, or None once
    the other end closed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(WorkerMessage, ext_hook=_ext_hook)

    @classmethod
    async def open(cls, sock: socket.socket) -> Link:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**26)
        return cls(reader, writer)

    def send(self, message: Any) -> None:
        if self.writer.is_closing():
            return
        body = self._encoder.encode(message)
        self.writer.write(_HEADER.pack(len(body)) + body)

    async def receive(self) -> Any | None:
        """The next message; None once the other end closed.

        Raises:
            ProxyWorkerError: a frame that is not a message of the link (the other end is not a peer).
        """
        try:
            size = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))[0]
            frame = await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, ValueError) as error:
            raise ProxyWorkerError(
                f"a frame on the proxy worker link is not a link message: {error}"
            ) from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def failure_message(request_id: int, error: BaseException) -> WorkerFailure:
    """``error``, raised by the run's client for generate ``request_id``, as its family crosses the link."""
    if isinstance(error, EngineError):
        kind = "request"
    elif isinstance(error, EngineDeadError):
        kind = "dead"
    elif isinstance(error, InferenceUnavailableError):
        kind = "unavailable"
    else:
        kind = "other"
    if isinstance(error, InferenceError):
        message, code, param, status = str(error), error.code, error.param, error.http_status
    else:  # a bug in the run's process: the worker's agent gets a 503, the run's log has the traceback
        message, code, param, status = f"{type(error).__name__}: {error}", "internal_error", None, 500
    return WorkerFailure(request_id, kind, message, code, param, status)


def failure_error(failure: WorkerFailure) -> InferenceError:
    """The inference error a ``WorkerFailure`` stands for, as the worker's sessions handle it."""
    if failure.kind == "request":
        cls = ContextLengthExceededError if failure.code == CONTEXT_LENGTH_EXCEEDED else EngineError
        error: InferenceError = cls(failure.message, code=failure.code, param=failure.param)
        error.http_status = failure.http_status
        return error
    if failure.kind == "dead":
        return EngineDeadError(failure.message)
    if failure.kind == "unavailable":
        return InferenceUnavailableError(failure.message)
    return InferenceError(failure.message, code=failure.code)


# ------------------------------------------------------------------------------------------ run's side


class WorkerSession:
    """A session opened on a proxy worker: ``base_url`` is what its agent uses."""

    def __init__(self, session_id: str, base_url: str, worker: _Worker):
        self.session_id = session_id
        self.base_url = base_url
        self.worker = worker
        self.closing: asyncio.Future[Trace] | None = None

    def __repr__(self) -> str:
        return f"WorkerSession({self.session_id!r}, worker={self.worker.index})"


class _Worker:
    """One worker process and the run's end of its link: answers its generate calls with the run's client,
    and matches replies to the open and close calls made on it."""

    def __init__(self, index: int, client: Any):
        self.index = index
        self.client = client
        self.process: CommandChild | None = None
        self.link: Link | None = None
        self.base_url = ""
        self.sessions = 0
        self.gone: str | None = None  # why the worker is no longer usable
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._generating: dict[int, asyncio.Task[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self, setup: WorkerSetup, timeout_s: float) -> None:
        ours, theirs = socket.socketpair()
        try:
            # Its output goes where this process's does; it stays in this process group, as before the
            # process layer (a terminal's Ctrl-C reaches it too, and it closes its sessions and exits).
            self.process = await start_command(
                [sys.executable, "-m", "rollflow.tito.worker", str(theirs.fileno())],
                name=f"proxy-worker-{self.index}",
                pass_fds=(theirs.fileno(),),
                own_group=False,
            )
        finally:
            theirs.close()
        try:
            self.link = await Link.open(ours)
            self.link.send(setup)
            ready = await asyncio.wait_for(self.link.receive(), timeout_s)
        except TimeoutError:
            await self.stop()
            raise ProxyWorkerError(
                f"proxy worker {self.index} did not listen within {timeout_s:g} s; its log is above"
            ) from None
        except BaseException:
            await self.stop()
            raise
        if not isinstance(ready, WorkerReady):
            code = await self.process.wait()
            self.gone = (
                f"proxy worker {self.index} exited with code {code} before it listened; its log is above"
            )
            raise ProxyWorkerError(self.gone)
        self.base_url = ready.base_url
        self._reader = asyncio.get_running_loop().create_task(self._read())
        log.debug("proxy worker listening", worker=self.index, base_url=self.base_url, pid=self.process.pid)

    async def call(self, message: WorkerOpen | WorkerClose) -> Any:
        """Send an open or close call (its ``call`` field is set here) and return the worker's answer.

        Raises:
            ProxyWorkerError: the worker is gone, or went before answering.
        """
        if self.gone is not None or self.link is None:
            raise ProxyWorkerError(self.gone or f"proxy worker {self.index} is not started")
        message.call = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[message.call] = future
        self.link.send(message)
        return await future

    async def _read(self) -> None:
        """Serve the worker's messages until its link closes or breaks; then the worker is lost."""
        assert self.link is not None
        reason = f"proxy worker {self.index} was stopped"
        try:
            await self._serve_link(self.link)
            code = None if self.process is None else self.process.returncode
            if code is None and self.process is not None:
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(self.process.wait(), 5.0)
            reason = f"proxy worker {self.index} exited (code {code}); its log is above"
        except ProxyWorkerError as error:
            reason = f"proxy worker {self.index}: {error}"
            log.error("proxy worker link broke", worker=self.index, error=str(error))
            self.link.close()
        finally:
            self._lose(reason)

    async def _serve_link(self, link: Link) -> None:
        while (message := await link.receive()) is not None:
            if isinstance(message, WorkerGenerate | WorkerStream):
                streamed = isinstance(message, WorkerStream)
                task = asyncio.get_running_loop().create_task(
                    self._answer(message.id, message.request, streamed)
                )
                self._generating[message.id] = task
            elif isinstance(message, WorkerCancel):
                task = self._generating.pop(message.id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(message, WorkerOpened | WorkerClosed):
                future = self._calls.pop(message.call, None)
                if future is not None and not future.done():
                    future.set_result(message)

    async def _answer(self, request_id: int, request: GenerateRequest, streamed: bool) -> None:
        """Generate ``request`` with the run's client and send the worker the output, each chunk of it
        (``streamed``), or the failure."""
        assert self.link is not None
        try:
            if streamed:
                async with contextlib.aclosing(self.client.generate_stream(request)) as chunks:
                    async for chunk in chunks:
                        self.link.send(WorkerChunk(request_id, chunk))
                return
            reply: Any = WorkerOutput(request_id, await self.client.generate(request))
        except asyncio.CancelledError:  # the worker's caller left: nobody waits (a closed stream ended)
            return
        except Exception as error:
            if not isinstance(error, InferenceError):
                log.exception("generating for a proxy worker failed", worker=self.index)
            reply = failure_message(request_id, error)
        finally:
            self._generating.pop(request_id, None)
        self.link.send(reply)

    def _lose(self, reason: str) -> None:
        """The worker is gone: its pending calls fail and its generations stop."""
        if self.gone is None:
            self.gone = reason
            if self._calls:
                log.error("proxy worker lost", worker=self.index, reason=reason)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ProxyWorkerError(reason))
        self._calls.clear()
        for task in self._generating.values():
            task.cancel()
        self._generating.clear()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close the link (the worker then closes its sessions and exits); kill it if it lingers."""
        self._lose(self.gone or f"proxy worker {self.index} was stopped")
        if self.link is not None:
            self.link.close()
        if self.process is not None:
            await self.process.stop(timeout_s, terminate=False)  # closing the link was the request to exit
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class ProxyWorkers:
    """The TITO proxy in ``workers`` processes (see the module docstring), used like a ``TITOProxy`` by
    whoever runs agents: ``open_session``, ``close_session``, ``model_name``.

    Args:
        client: the inference client every worker's generations go through (in this process).
        renderer: a ``renderers`` renderer (or a ``TITORenderer``), sent to the workers pickled.
        tokenizer: the model's tokenizer, likewise.
        workers: how many worker processes; sessions go to the one with the fewest open.
        start_timeout_s: how long a worker may take to listen.
        **options: ``TITOProxy`` keyword arguments for every worker (``model_name`` is required). ``port``
            and ``advertise_url`` name one listener, so they need ``workers = 1``.

    Raises:
        ValueError: ``workers < 1``, or ``port``/``advertise_url`` with several workers.
    """

    def __init__(
        self,
        client: Any,
        renderer: Any,
        tokenizer: Any,
        *,
        workers: int = 1,
        start_timeout_s: float = 120.0,
        **options: Any,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if workers > 1 and (options.get("port") or options.get("advertise_url")):
            raise ValueError(
                "port and advertise_url name one listener; with several proxy workers each listens on a free port"
            )
        if "model_name" not in options:
            raise ValueError("model_name is required")
        # Fixed components and settings.
        self.client = client
        self.renderer = renderer if isinstance(renderer, TITORenderer) else TITORenderer(renderer, tokenizer)
        self.model_name: str = options["model_name"]
        self.max_sessions: int = options.get("max_sessions", DEFAULT_MAX_SESSIONS)
        self.num_workers = workers
        self.start_timeout_s = start_timeout_s
        self._setup = WorkerSetup(
            pickle.dumps(
                (self.renderer.renderer, self.renderer.tokenizer, options), protocol=pickle.HIGHEST_PROTOCOL
            ),
            streams=hasattr(client, "generate_stream"),
        )
        # Runtime state.
        self._workers: list[_Worker] = []
        self._sessions: dict[str, WorkerSession] = {}
        self._closed: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._replacement: asyncio.Task[None] | None = None

    @property
    def sessions(self) -> list[WorkerSession]:
        """Open sessions."""
        return list(self._sessions.values())

    @property
    def worker_urls(self) -> list[str]:
        """Where each worker's proxy listens."""
        return [worker.base_url for worker in self._workers]

    async def start(self) -> None:
        """Start every worker and wait until each listens; on a failure the started ones are stopped.

        Raises:
            ProxyWorkerError: a worker did not start.
        """
        self._workers = [_Worker(index, self.client) for index in range(self.num_workers)]
        results = await asyncio.gather(
            *(worker.start(self._setup, self.start_timeout_s) for worker in self._workers),
            return_exceptions=True,
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            workers, self._workers = self._workers, []
            await asyncio.gather(*(worker.stop() for worker in workers))
            raise failures[0]

    async def close(self) -> None:
        """Close every open session, then stop the workers. Idempotent."""
        try:
            for session in list(self._sessions.values()):
                with contextlib.suppress(RollflowError):
                    await self.close_session(session)
        finally:
            workers, self._workers = self._workers, []
            if self._replacement is not None:
                self._replacement.cancel()
            await asyncio.gather(*(worker.stop() for worker in workers))

    async def __aenter__(self) -> ProxyWorkers:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open_session(self, session_id: str | None = None) -> WorkerSession:
        """A new session on the least busy live worker (a lost worker is replaced first when none is live).

        Raises:
            ValueError: ``session_id`` is already in use, or not 1-128 letters, digits, '.', '_', '-'.
            ProxyWorkerError: no worker could take it.
            RequestError: ``max_sessions`` sessions are open already over all workers (status 429).
        """
        if len(self._sessions) >= self.max_sessions:
            raise too_many_sessions(len(self._sessions), self.max_sessions)
        session_id = claim_session_id(session_id, self._sessions, self._closed)
        worker = await self._live_worker()
        worker.sessions += 1
        try:
            opened = await worker.call(WorkerOpen(0, session_id))
            if opened.error is not None:
                raise ValueError(opened.error)
        except BaseException:
            worker.sessions -= 1
            raise
        session = WorkerSession(session_id, opened.base_url, worker)
        self._sessions[session_id] = session
        return session

    def get_session(self, session_id: str) -> WorkerSession | None:
        """The open session with this id, or None."""
        return self._sessions.get(session_id)

    async def close_session(
        self,
        session: WorkerSession,
        *,
        error: str | None = None,
        timed_out: bool = False,
        drain_timeout_s: float | None = None,
    ) -> Trace:
        """``TITOProxy.close_session`` on the session's worker, which sends the sealed trace back. A session
        whose worker is gone gets an empty sealed trace that names why. Closing again returns the same trace."""
        if session.closing is None:
            session.closing = asyncio.get_running_loop().create_task(
                self._close(session, error, timed_out, drain_timeout_s)
            )
        return await asyncio.shield(session.closing)

    async def _close(
        self, session: WorkerSession, error: str | None, timed_out: bool, drain_timeout_s: float | None
    ) -> Trace:
        try:
            closed = await session.worker.call(
                WorkerClose(0, session.session_id, error, timed_out, drain_timeout_s)
            )
            if closed.error is not None:
                raise ProxyWorkerError(closed.error)
            trace: Trace = pickle.loads(closed.trace)
        except ProxyWorkerError as lost:
            trace = Trace(self.renderer, session.session_id)
            trace.errors.append(str(lost))
            trace.end(error=error, timed_out=timed_out)
        finally:
            session.worker.sessions -= 1
            self._sessions.pop(session.session_id, None)
            remember_closed(self._closed, session.session_id)
        trace.renderer = self.renderer
        finish_session = getattr(self.client, "finish_session", None)
        if finish_session is not None:  # a router forgets which server the session was pinned to
            await finish_session(session.session_id)
        return trace

    async def _live_worker(self) -> _Worker:
        """The live worker with the fewest open sessions. Lost workers are replaced: in the background while
        others are live, else before returning."""
        if not self._workers:
            raise ProxyWorkerError("the proxy workers are not started (use `async with ProxyWorkers(...)`)")
        if any(worker.gone is not None for worker in self._workers) and self._replacement is None:
            self._replacement = asyncio.get_running_loop().create_task(self._replace_lost())
        live = [worker for worker in self._workers if worker.gone is None]
        if not live:
            await asyncio.shield(self._replacement)
            live = [worker for worker in self._workers if worker.gone is None]
            if not live:
                raise ProxyWorkerError("every proxy worker is lost and none could be started in its place")
        return min(live, key=lambda worker: worker.sessions)

    async def _replace_lost(self) -> None:
        try:
            for index, lost in enumerate(self._workers):
                if lost.gone is None:
                    continue
                log.warning("starting a proxy worker in place of a lost one", worker=index, reason=lost.gone)
                await lost.stop()
                worker = _Worker(index, self.client)
                try:
                    await worker.start(self._setup, self.start_timeout_s)
                except ProxyWorkerError:
                    log.exception("a proxy worker could not be started in place of a lost one", worker=index)
                    continue
                # Sessions of the lost worker still close (empty) through it; the new one starts with none.
                if self._workers and self._workers[index] is lost:
                    self._workers[index] = worker
                else:  # closed meanwhile
                    await worker.stop()
        finally:
            self._replacement = None
