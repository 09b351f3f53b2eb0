"""The TITO proxy in worker processes (``rollflow.tito.workers``): real worker processes, real HTTP agents
(aiohttp and the official ``openai`` client), the run's client in this process. Each test that starts
workers pays ~2 s for the worker's start-up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import socket

import aiohttp
import numpy as np
import pytest

from rollflow.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    EngineGenerateError,
    InferenceError,
    InferenceUnavailableError,
)
from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest, SamplingParams, WorkerOutput
from rollflow.tito.trace import Trace
from rollflow.tito.workers import Link, ProxyWorkerError, ProxyWorkers, failure_error, failure_message
from tests.helpers.processes import process_alive
from tests.helpers.tito import MODEL, ScriptedClient, as_history_message
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.asyncio


def workers_over(client, chat, **options) -> ProxyWorkers:
    options.setdefault("workers", 1)
    return ProxyWorkers(client, chat.renderer, chat.tokenizer, model_name=MODEL, **options)


def prompt_ids(turn) -> list[int]:
    return turn.node.prefix_ids()[: turn.prompt_len].tolist()


async def post_chat(base_url: str, messages: list[dict], **fields) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **fields}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base_url}/chat/completions", json=body) as response,
    ):
        return response.status, await response.json(content_type=None)


# ---------------------------------------------------------------------------------- sessions end to end


@pytest.mark.slow
async def test_sessions_on_workers_record_the_same_tree_as_in_process(inference_client, tiny_chat):
    """Two agents (the official openai client) on two workers: each session's turns are sampled by the run's
    engine, bridged in its worker, and its sealed trace comes back with exact tokens and the run's renderer."""
    import openai

    async with workers_over(inference_client, tiny_chat, workers=2) as proxy:
        assert len(set(proxy.worker_urls)) == 2
        sessions = [await proxy.open_session(f"agent-{i}") for i in range(2)]
        assert {s.worker.index for s in sessions} == {0, 1}  # the least busy worker takes each
        assert [s.session_id for s in proxy.sessions] == ["agent-0", "agent-1"]

        async def agent(session) -> list[dict]:
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            history = [{"role": "user", "content": f"hello from {session.session_id}"}]
            for _ in range(2):
                reply = await client.chat.completions.create(
                    model=MODEL, messages=history, max_tokens=6, seed=3, logprobs=True
                )
                history += [
                    reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go"},
                ]
            await client.close()
            return history

        histories = await asyncio.gather(*(agent(s) for s in sessions))
        traces = [await proxy.close_session(s) for s in sessions]
        assert proxy.sessions == []
    for trace, history, session in zip(traces, histories, sessions, strict=True):
        assert trace.sealed and trace.session_id == session.session_id
        assert trace.renderer is proxy.renderer
        assert [turn.render.method for turn in trace.turns] == ["full", "bridge"]
        assert trace.stats.turns == 2 and trace.errors == []
        # The second prompt is the first prompt, the sampled reply and the bridged user message, token for token.
        first, second = trace.turns
        first_prompt = tiny_chat.renderer.render_ids(history[:1], add_generation_prompt=True)
        assert prompt_ids(first) == first_prompt
        assert prompt_ids(second)[: len(first_prompt) + len(first.completion_ids)] == [
            *first_prompt,
            *first.completion_ids,
        ]
        assert len(first.logprobs) == len(first.completion_ids) > 0


@pytest.mark.slow
async def test_close_twice_returns_the_same_trace_and_ids_stay_taken(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with workers_over(client, tiny_chat) as proxy:
        session = await proxy.open_session("once")
        status, body = await post_chat(session.base_url, [{"role": "user", "content": "hi"}])
        assert status == 200 and body["choices"][0]["message"]["content"] == "reply 0"
        first, again = await asyncio.gather(proxy.close_session(session), proxy.close_session(session))
        assert first is again is await proxy.close_session(session)
        assert first.stats.turns == 1 and len(first.turns[0].completion_ids) == len(
            client.outputs[0].token_ids
        )
        with pytest.raises(ValueError, match="already in use"):
            await proxy.open_session("once")
        # The closed session's URL is refused by its worker.
        status, body = await post_chat(session.base_url, [{"role": "user", "content": "hi"}])
        assert status == 409 and body["error"]["code"] == "session_closed"
        # The run asked the engine exactly once.
        assert len(client.requests) == 1


async def test_side_calls_are_named_and_kept_untrained_on_workers(tiny_chat):
    from rollflow.tito import compose
    from rollflow.tito.side_calls import SideCallRule

    client = ScriptedClient(tiny_chat.tokenizer)
    rule = SideCallRule(models=("title-model",), header="x-side-call")
    async with workers_over(client, tiny_chat, side_calls=rule) as proxy:
        session = await proxy.open_session()
        hi = [{"role": "user", "content": "hi"}]
        assert (await post_chat(session.base_url, hi))[0] == 200
        assert (await post_chat(session.base_url, hi, model="title-model"))[0] == 200
        assert (await post_chat(session.base_url, hi, model="other"))[0] == 404
        trace = await proxy.close_session(session)
    assert trace.side_calls == {"model:title-model": 1} and len(trace.side_nodes) == 1
    (sample,) = compose(trace, reward=1.0, max_seq_len=1000)
    assert sample.completion_token_ids == client.outputs[0].token_ids  # the trainable call only


class StreamSpy:
    """The real client, counting which of its calls the workers used."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = {"generate": 0, "generate_stream": 0}
        self.chunks_with_tokens = 0  # an engine over HTTP may send several tokens in one chunk

    async def generate(self, request):
        self.calls["generate"] += 1
        return await self.inner.generate(request)

    async def generate_stream(self, request):
        self.calls["generate_stream"] += 1
        async with contextlib.aclosing(self.inner.generate_stream(request)) as chunks:
            async for chunk in chunks:
                self.chunks_with_tokens += bool(chunk.token_ids)
                yield chunk


@pytest.mark.slow
async def test_streamed_turns_stream_across_the_link(inference_client, tiny_chat):
    """``stream: true`` through a worker: the run's client streams, the agent gets the reply in deltas, and
    the deltas add up to what the trace recorded."""
    import openai

    spy = StreamSpy(inference_client)
    async with workers_over(spy, tiny_chat) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=12, seed=5, stream=True
        )
        deltas = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        await client.close()
        trace = await proxy.close_session(session)
    assert spy.calls == {"generate": 0, "generate_stream": 1}
    # The reply reached the agent as deltas (how many depends on the load: the proxy sends what was sampled
    # since its last parse, so a busy machine coalesces a 12-token reply; that deltas come while sampling goes
    # on is shown by test_an_agent_that_leaves_a_stream_ends_the_runs_stream's 20-second stream).
    assert spy.chunks_with_tokens >= 1
    assert len([d for d in deltas if d]) >= 1
    assert "".join(d or "" for d in deltas) == trace.turns[0].message["content"]


class SlowStream(ScriptedClient):
    """Streams one token every 50 ms, up to 400; records whether its stream was closed before the end."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.closed_early = asyncio.Event()

    async def generate_stream(self, request):
        from rollflow.messages import GenerateChunk

        self.requests.append(request)
        finished = False
        try:
            for i in range(400):
                await asyncio.sleep(0.05)
                finished = i == 399
                yield GenerateChunk(
                    request.request_id, [11], [-0.5], [0], FinishReason.LENGTH if finished else None
                )
        finally:
            if not finished:
                self.closed_early.set()


@pytest.mark.slow
async def test_an_agent_that_leaves_a_stream_ends_the_runs_stream(tiny_chat):
    client = SlowStream(tiny_chat.tokenizer)
    async with workers_over(client, tiny_chat) as proxy:
        session = await proxy.open_session()
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "stream": True,
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{session.base_url}/chat/completions", json=body) as response,
        ):
            assert response.status == 200
            # Three deltas with text cross the link while the run's stream (400 tokens, 20 s) goes on.
            with_text = 0
            while with_text < 3:
                line = await response.content.readline()
                assert line, "the stream ended early"
                if line.startswith(b"data: {"):
                    choices = json.loads(line[len(b"data: ") :])["choices"]
                    with_text += any(choice["delta"].get("content") for choice in choices)
            assert not client.closed_early.is_set() and len(client.requests) == 1
        # Leaving the block closed the connection mid-stream.
        await asyncio.wait_for(client.closed_early.wait(), 60)
        await proxy.close_session(session, drain_timeout_s=0)


# -------------------------------------------------------------------------- errors cross the link


class FailingClient(ScriptedClient):
    """Raises, on every generate, the error its session's id names (``errors[session_id]``)."""

    def __init__(self, tokenizer, errors: dict[str, BaseException]):
        super().__init__(tokenizer)
        self.errors = errors

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        raise self.errors[request.session_id]


ENGINE_FAILURES = {  # session id: (what the run's client raises, the agent's status and error code)
    "context": (
        ContextLengthExceededError("prompt of 600 tokens exceeds 512"),
        400,
        "context_length_exceeded",
    ),
    "vocabulary": (
        EngineError("token 999999 is outside the vocabulary", param="prompt"),
        400,
        "invalid_request",
    ),
    "forward": (EngineGenerateError("the forward failed"), 503, "service_unavailable"),
    "dead": (EngineDeadError("the engine loop died"), 503, "service_unavailable"),
    "bug": (RuntimeError("a bug in the run's client"), 503, "service_unavailable"),
}


@pytest.mark.slow
async def test_engine_errors_reach_the_agent_as_in_process(tiny_chat):
    """The agent hears the status and code an in-process proxy would give it; failures that are not the
    request's own are recorded on the trace (which masks the trajectory)."""
    errors = {name: error for name, (error, _, _) in ENGINE_FAILURES.items()}
    async with workers_over(FailingClient(tiny_chat.tokenizer, errors), tiny_chat) as proxy:
        for name, (error, status, code) in ENGINE_FAILURES.items():
            session = await proxy.open_session(name)
            got, body = await post_chat(session.base_url, [{"role": "user", "content": "hi"}])
            trace = await proxy.close_session(session)
            assert (got, body["error"]["code"]) == (status, code), (name, body)
            assert str(error) in body["error"]["message"]
            assert bool(trace.errors) == (status >= 500), name


async def test_failures_keep_their_family_across_the_link():
    cases = [
        ContextLengthExceededError("too long", param="messages"),
        EngineError("bad token", param="prompt"),
        EngineDeadError("dead"),
        InferenceUnavailableError("no server"),
        InferenceError("odd", code="odd_code"),
    ]
    for original in cases:
        rebuilt = failure_error(failure_message(7, original))
        assert type(rebuilt) is type(original)
        assert (str(rebuilt), rebuilt.code, rebuilt.param, rebuilt.http_status) == (
            str(original),
            original.code,
            original.param,
            original.http_status,
        )
    bug = failure_error(failure_message(1, KeyError("x")))
    assert type(bug) is InferenceError and "KeyError" in str(bug) and bug.http_status == 500


# ------------------------------------------------------------------------------------ cancellation


@pytest.mark.slow
async def test_an_agent_that_disconnects_cancels_the_runs_generate(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer, delay_s=60)
    async with workers_over(client, tiny_chat) as proxy:
        session = await proxy.open_session()
        agent = asyncio.ensure_future(post_chat(session.base_url, [{"role": "user", "content": "hi"}]))
        await wait_until(lambda: client.requests, "the agent's request reaches the run's generate")
        agent.cancel()  # the agent disconnects
        with pytest.raises(asyncio.CancelledError):
            await agent
        await wait_until(lambda: client.cancelled, "the disconnect cancels the run's generate")
        assert client.cancelled == 1
        trace = await proxy.close_session(session)
    assert trace.stats.turns == 0


@pytest.mark.slow
async def test_close_without_drain_cancels_requests_in_flight(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer, delay_s=60)
    async with workers_over(client, tiny_chat) as proxy:
        session = await proxy.open_session()
        request = asyncio.ensure_future(post_chat(session.base_url, [{"role": "user", "content": "hi"}]))
        await wait_until(lambda: client.requests, "the request reaches the run's generate")
        trace = await asyncio.wait_for(
            proxy.close_session(session, error="agent failed", drain_timeout_s=0), 60
        )
        status, body = await request
        # While the worker lives: its cancel, not its shutdown, ended the run's generate.
        await wait_until(lambda: client.cancelled, "the close cancels the run's generate")
        assert client.cancelled == 1
    assert status == 409 and body["error"]["code"] == "session_closed"
    assert trace.error == "agent failed" and trace.sealed


# ------------------------------------------------------------------------------------- lost workers


@pytest.mark.slow
async def test_a_lost_worker_masks_its_sessions_and_is_replaced(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with workers_over(client, tiny_chat) as proxy:
        session = await proxy.open_session("doomed")
        lost = session.worker
        os.kill(lost.process.pid, signal.SIGKILL)
        await asyncio.wait_for(lost.process.wait(), 60)
        trace = await asyncio.wait_for(proxy.close_session(session, timed_out=True), 60)
        assert trace.sealed and trace.timed_out and trace.stats.turns == 0
        assert "proxy worker 0 exited" in trace.errors[0]
        # No live worker: the next session waits for a new one, which serves it.
        fresh = await asyncio.wait_for(proxy.open_session(), 60)
        assert fresh.worker is not lost and fresh.worker.process.pid != lost.process.pid
        status, body = await post_chat(fresh.base_url, [{"role": "user", "content": "hi"}])
        assert status == 200, body
        assert (await proxy.close_session(fresh)).stats.turns == 1


@pytest.mark.slow
async def test_a_worker_that_cannot_start_fails_start_with_its_exit_code(tiny_chat):
    proxy = workers_over(ScriptedClient(tiny_chat.tokenizer), tiny_chat, not_an_option=1)
    with pytest.raises(ProxyWorkerError, match=r"proxy worker 0 exited with code 1 before it listened"):
        await asyncio.wait_for(proxy.start(), 60)
    with pytest.raises(ProxyWorkerError, match="not started"):
        await proxy.open_session()


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.slow
async def test_bad_arguments_and_session_ids_are_refused(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        workers_over(client, tiny_chat, workers=0)
    with pytest.raises(ValueError, match="port and advertise_url"):
        workers_over(client, tiny_chat, workers=2, port=8123)
    with pytest.raises(ValueError, match="port and advertise_url"):
        workers_over(client, tiny_chat, workers=2, advertise_url="http://proxy:8000")
    with pytest.raises(ValueError, match="model_name is required"):
        ProxyWorkers(client, tiny_chat.renderer, tiny_chat.tokenizer)
    async with workers_over(client, tiny_chat) as proxy:
        for bad in ("", "has space", "x" * 129, "slash/in"):
            with pytest.raises(ValueError, match="must be 1-128 letters"):
                await proxy.open_session(bad)
        await proxy.open_session("taken")
        with pytest.raises(ValueError, match="already in use"):
            await proxy.open_session("taken")
        assert proxy.get_session("taken") is not None and proxy.get_session("other") is None
    # Closing the proxy closed the open session.
    assert proxy.sessions == []


# ------------------------------------------------------------------------------- what crosses the link


async def test_a_sealed_trace_pickles_without_its_renderer(tiny_chat):
    from rollflow.tito.testing import make_session
    from tests.helpers.tito import ask

    session = make_session(ScriptedClient(tiny_chat.tokenizer), tiny_chat)
    turn = await ask(session, [{"role": "user", "content": "hi"}])
    history = [
        {"role": "user", "content": "hi"},
        as_history_message(turn),
        {"role": "user", "content": "more"},
    ]
    await ask(session, history)
    trace = session.trace
    trace.sealed = True
    copy = pickle.loads(pickle.dumps(trace))
    assert copy.renderer is None and copy.to_dict() == trace.to_dict()
    assert [prompt_ids(t) for t in copy.turns] == [prompt_ids(t) for t in trace.turns]


async def test_trace_with_queued_operations_refuses_to_pickle(tiny_chat):
    from rollflow.tito.renderer import TITORenderer

    trace = Trace(TITORenderer(tiny_chat.renderer, tiny_chat.tokenizer), "busy")
    trace._mailbox.append((print, (), asyncio.get_running_loop().create_future(), False))
    with pytest.raises(RuntimeError, match="seal it first"):
        pickle.dumps(trace)


async def test_outputs_with_routed_experts_cross_the_link():
    ours, theirs = socket.socketpair()
    a, b = await Link.open(ours), await Link.open(theirs)
    routes = np.arange(24, dtype=np.int16).reshape(3, 2, 4)
    output = GenerateOutput("r", [1, 2], [-0.5, -0.25], FinishReason.STOP, [0, 0], 2, routes, [3, 0])
    a.send(WorkerOutput(5, output))
    got = await b.receive()
    assert isinstance(got, WorkerOutput) and got.id == 5
    assert got.output.token_ids == [1, 2] and got.output.finish_reason is FinishReason.STOP
    assert got.output.routed_experts.dtype == np.int16 and np.array_equal(got.output.routed_experts, routes)
    a.close()
    assert await b.receive() is None  # the other end closed
    b.close()


async def test_generate_requests_round_trip_through_the_link_encoding():
    import msgspec

    from rollflow.messages import WorkerGenerate, WorkerMessage

    request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=4, seed=9, stop_token_ids=(7,)), "id", "s")
    encoded = msgspec.msgpack.encode(WorkerGenerate(3, request))
    assert msgspec.msgpack.decode(encoded, type=WorkerMessage) == WorkerGenerate(3, request)


ORPHAN = r"""
import asyncio, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from rollflow.tito.testing import load_tiny_chat
from rollflow.tito.workers import ProxyWorkers
sys.path.insert(0, os.getcwd())
from tests.helpers.tito import ScriptedClient

async def main():
    chat = load_tiny_chat()
    async with ProxyWorkers(ScriptedClient(chat.tokenizer), chat.renderer, chat.tokenizer, model_name="m") as proxy:
        await proxy.open_session("left-open")
        print("worker", proxy._workers[0].process.pid, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_workers_exit_when_the_run_is_killed():
    """No orphans: a worker whose run dies (SIGKILL, no cleanup) sees its link close and exits."""
    import sys

    run = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ORPHAN, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        line = b""
        while not line.startswith(b"worker "):
            line = await asyncio.wait_for(run.stdout.readline(), 120)
            assert line, "the run exited before its worker started"
        worker_pid = int(line.split()[1])
    finally:
        run.kill()
        await run.wait()
    try:  # gone, or a zombie (exited, waiting to be reaped by init)
        await wait_until(lambda: not process_alive(worker_pid), "the proxy worker exits after its run")
    except TimeoutError:
        os.kill(worker_pid, signal.SIGKILL)
        raise


async def test_a_frame_that_is_not_a_link_message_loses_the_worker(tiny_chat):
    """A peer that writes garbage is not a worker: its pending calls fail and it is marked lost, instead of
    the run waiting forever on a reader that died."""
    from rollflow.messages import WorkerOpen
    from rollflow.tito.workers import _Worker

    ours, theirs = socket.socketpair()
    worker = _Worker(0, ScriptedClient(tiny_chat.tokenizer))
    worker.link = await Link.open(ours)
    worker._reader = asyncio.get_running_loop().create_task(worker._read())
    peer = await Link.open(theirs)
    call = asyncio.ensure_future(worker.call(WorkerOpen(0, "s")))
    await wait_until(lambda: worker._calls, "the call is sent and waits for its answer")
    peer.writer.write(b"\x00\x00\x00\x03abc")
    with pytest.raises(ProxyWorkerError, match="not a link message"):
        await asyncio.wait_for(call, 60)
    assert worker.gone is not None and "not a link message" in worker.gone
    await worker.stop()
    peer.close()
