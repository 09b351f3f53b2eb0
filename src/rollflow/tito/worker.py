"""A TITO proxy worker process (``python -m rollflow.tito.worker FD``), started by ``ProxyWorkers``.

It reads its setup from the socket ``FD`` (its end of the link to the run's process), serves a ``TITOProxy``
whose generations go back over the link, opens and closes sessions when the run asks, and exits when the run
closes the link (after closing its sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import socket
import sys
from collections.abc import AsyncIterator

import structlog

from rollflow.errors import InferenceUnavailableError, RequestError
from rollflow.logs import configure_logging
from rollflow.messages import (
    GenerateChunk,
    GenerateOutput,
    GenerateRequest,
    WorkerCancel,
    WorkerChunk,
    WorkerClose,
    WorkerClosed,
    WorkerFailure,
    WorkerGenerate,
    WorkerOpen,
    WorkerOpened,
    WorkerOutput,
    WorkerReady,
    WorkerSetup,
    WorkerStream,
)
from rollflow.tito.workers import Link, failure_error

log = structlog.get_logger(__name__)


class LinkClient:
    """The run's inference client as a worker's sessions see it: each ``generate`` crosses the link, and a
    caller that leaves cancels the run's call."""

    def __init__(self, link: Link):
        self._link = link
        self._pending: dict[int, asyncio.Future[GenerateOutput]] = {}
        self._streams: dict[int, asyncio.Queue[GenerateChunk | BaseException]] = {}
        self._ids = itertools.count()
        self._lost: str | None = None

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if self._lost is not None:
            raise InferenceUnavailableError(self._lost)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._link.send(WorkerGenerate(request_id, request))
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(request_id, None) is not None:
                self._link.send(WorkerCancel(request_id))
            raise

    def answer(self, message: WorkerOutput | WorkerChunk | WorkerFailure) -> None:
        stream = self._streams.get(message.id)
        if stream is not None:
            stream.put_nowait(message.chunk if isinstance(message, WorkerChunk) else failure_error(message))
            return
        future = self._pending.pop(message.id, None)
        if future is None or future.done() or isinstance(message, WorkerChunk):
            return
        if isinstance(message, WorkerOutput):
            future.set_result(message.output)
        else:
            future.set_exception(failure_error(message))

    def lose(self, reason: str) -> None:
        """The link is gone: every pending and later call fails as unavailable."""
        self._lost = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(InferenceUnavailableError(reason))
        self._pending.clear()
        for stream in self._streams.values():
            stream.put_nowait(InferenceUnavailableError(reason))


class StreamingLinkClient(LinkClient):
    """A ``LinkClient`` for a run whose client streams: ``generate_stream`` crosses the link chunk by chunk."""

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._lost is not None:
            raise InferenceUnavailableError(self._lost)
        request_id = next(self._ids)
        chunks: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self._streams[request_id] = chunks
        self._link.send(WorkerStream(request_id, request))
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    finished = True  # the run's side is done with it
                    raise chunk
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            del self._streams[request_id]
            if not finished:  # left early: the run ends its generation
                self._link.send(WorkerCancel(request_id))


async def serve(fd: int) -> None:
    from rollflow.eventloop import tune_gc_for_serving
    from rollflow.tito.proxy import TITOProxy

    link = await Link.open(socket.socket(fileno=fd))
    setup = await link.receive()
    if not isinstance(setup, WorkerSetup):
        return  # the run went away before it sent the setup
    renderer, tokenizer, options = pickle.loads(setup.payload)
    client = StreamingLinkClient(link) if setup.streams else LinkClient(link)
    closing: set[asyncio.Task[None]] = set()
    async with TITOProxy(client, renderer, tokenizer, **options) as proxy:
        tune_gc_for_serving()

        async def close(message: WorkerClose) -> None:
            session = proxy.get_session(message.session_id)
            if session is None:
                link.send(
                    WorkerClosed(message.call, b"", f"no open session {message.session_id!r} on this worker")
                )
                return
            try:
                trace = await proxy.close_session(
                    session,
                    error=message.error,
                    timed_out=message.timed_out,
                    drain_timeout_s=message.drain_timeout_s,
                )
                data = pickle.dumps(trace, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # the run must hear of it, or its close would wait forever
                log.exception("closing a session failed", session=message.session_id)
                link.send(WorkerClosed(message.call, b"", f"closing the session failed: {error!r}"))
            else:
                link.send(WorkerClosed(message.call, data))

        link.send(WorkerReady(proxy.public_url))
        while (message := await link.receive()) is not None:
            if isinstance(message, WorkerOutput | WorkerChunk | WorkerFailure):
                client.answer(message)
            elif isinstance(message, WorkerOpen):
                try:
                    session = await proxy.open_session(message.session_id)
                except (ValueError, RequestError) as error:  # a bad or taken id, or too many sessions
                    link.send(WorkerOpened(message.call, "", str(error)))
                else:
                    link.send(WorkerOpened(message.call, session.base_url))
            elif isinstance(message, WorkerClose):
                task = asyncio.get_running_loop().create_task(close(message))
                closing.add(task)
                task.add_done_callback(closing.discard)
        # The run closed the link (or died): nothing can be generated or handed back any more.
        client.lose("the run's process closed the link to this proxy worker")
        for task in closing:
            task.cancel()


def main(argv: list[str] | None = None) -> None:
    from rollflow.eventloop import run

    args = sys.argv[1:] if argv is None else argv
    configure_logging("info")
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(int(args[0])))


if __name__ == "__main__":
    main()
