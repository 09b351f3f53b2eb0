"""``TorchEngine.generate_stream`` and a client's ``generate_stream`` (in the suite's inference mode): tokens
arrive as they are sampled, the assembled stream equals ``generate``, and abort, early close and bad input
behave as documented."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from rollflow.errors import EngineError
from rollflow.inference.client import collect_stream
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams

from .helpers.waits import wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engine(uncached_engine):
    return uncached_engine


def request(max_tokens: int = 32, seed: int | None = 7, request_id: str = "r", **sampling) -> GenerateRequest:
    return GenerateRequest(
        [5, 17, 300, 42], SamplingParams(max_tokens=max_tokens, seed=seed, **sampling), request_id=request_id
    )


async def test_assembled_stream_equals_generate(engine):
    chunks = [chunk async for chunk in engine.generate_stream(request(64))]
    assert (
        all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason is FinishReason.LENGTH
    )
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.policy_versions) for c in chunks)

    async def replay():
        for chunk in chunks:
            yield chunk

    assert await collect_stream(replay()) == await engine.generate(request(64))


async def test_tokens_arrive_while_the_request_is_still_running(engine):
    seen_running = []
    num_chunks = 0
    async for chunk in engine.generate_stream(request(600)):
        num_chunks += 1
        if chunk.finish_reason is None:
            seen_running.append(engine.num_running == 1)
    # Many chunks came while the request was still being decoded: the stream is incremental. The worker
    # thread may finish the request while the last chunks before the outcome are read, so only the order is
    # exact: running, then (perhaps) not.
    assert num_chunks > 10 and sum(seen_running) > 10
    assert seen_running == sorted(seen_running, reverse=True)


async def test_abort_ends_the_stream_with_its_partial_tokens(engine):
    stream = engine.generate_stream(request(800, request_id="to-abort"))
    first = await anext(stream)
    assert first.token_ids and first.finish_reason is None
    assert await engine.abort(["to-abort"]) == 1
    rest = [chunk async for chunk in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    tokens = first.token_ids + [t for c in rest for t in c.token_ids]
    assert 0 < len(tokens) < 800


async def test_pause_abort_ends_streams_and_pause_keep_freezes_them(engine):
    stream = engine.generate_stream(request(800))
    await anext(stream)
    await engine.pause("abort")
    assert [c async for c in stream][-1].finish_reason is FinishReason.ABORT
    await engine.resume()

    stream = engine.generate_stream(request(400))  # long enough to be running still when the pause lands
    first = await anext(stream)
    await engine.pause("keep")
    await asyncio.sleep(0.05)  # a window for a drop that must not come: slowness can only hide one
    assert engine.num_running == 1
    await engine.resume()
    chunks = [first] + [c async for c in stream]
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 400


async def test_leaving_the_stream_early_aborts_the_request(engine):
    cancelled = engine.num_cancelled_requests
    async with contextlib.aclosing(engine.generate_stream(request(800))) as stream:
        async for _ in stream:
            break
    await wait_until(lambda: engine.num_running == 0, "the aborted request leaves its slot")
    assert engine.num_cancelled_requests == cancelled + 1

    # A consumer cancelled while waiting for the next chunk aborts it too.
    async def consume() -> None:
        async for _ in engine.generate_stream(request(800)):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: engine.num_running == 1, "the stream's request is running")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.num_running == 0, "the aborted request leaves its slot")
    assert engine.num_cancelled_requests == cancelled + 2


async def test_bad_request_raises_when_the_iteration_starts(engine):
    stream = engine.generate_stream(GenerateRequest([], SamplingParams()))
    with pytest.raises(EngineError, match="prompt_token_ids is empty"):
        await anext(stream)


async def test_a_client_streams_like_it_generates(inference_client):
    """Greedy, so the tokens are equal; the logprobs only nearly (the second call may extend the first's
    cached prefix rather than prefill, which changes the last bits)."""
    greedy = request(48, temperature=0.0, seed=None)
    streamed = await collect_stream(inference_client.generate_stream(greedy))
    whole = await inference_client.generate(greedy)
    assert streamed.token_ids == whole.token_ids and whole.token_ids
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert (streamed.finish_reason, streamed.prompt_len) == (whole.finish_reason, whole.prompt_len)
    assert streamed.policy_versions == whole.policy_versions == [0] * len(whole.token_ids)
