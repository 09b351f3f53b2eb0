"""``RemoteInferenceClient.generate_stream`` through a real router to two real ``rollflow serve`` servers:
SSE from ``/v1/completions`` passes the router chunk by chunk, the assembled stream equals ``generate``, and
leaving it early, pauses and bad input behave like the non-streamed call."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import pytest_asyncio

from rollflow.inference.client import collect_stream
from rollflow.inference.remote import RemoteInferenceClient, RemoteInferenceError
from rollflow.inference.router import InferenceRouter
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams

from .helpers.servers import server_metric
from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="RemoteInferenceClient's stream parsing through a real router"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(inference_servers):
    async with InferenceRouter(inference_servers.urls, health_check_interval_s=0.5) as router:
        yield router, inference_servers.urls


@pytest_asyncio.fixture(loop_scope="module")
async def client(servers):
    router, urls = servers
    async with RemoteInferenceClient(router.url, urls, control_timeout_s=30, request_timeout_s=60) as client:
        yield client


def request(max_tokens: int, request_id: str = "", session_id: str | None = "streams", **sampling):
    return GenerateRequest(
        [5, 6, 7], SamplingParams(max_tokens=max_tokens, **sampling), request_id, session_id=session_id
    )


async def test_assembled_stream_equals_generate(client):
    same = request(40, request_id="same-id", seed=5, stop_token_ids=(7, 9))
    # Both computed from scratch: a prefix-cache hit would change logprobs in the last bits.
    await client.reset_prefix_cache()
    whole = await client.generate(same)
    await client.reset_prefix_cache()
    streamed = await collect_stream(client.generate_stream(same))
    assert streamed == whole
    assert streamed.policy_versions == [0] * len(streamed.token_ids)


async def test_chunks_arrive_through_the_router_while_sampling(client):
    before = await server_metric(client.server_urls, "vllm:generation_tokens")
    generated_at_first, chunks, tokens = None, 0, 0
    async for chunk in client.generate_stream(request(1500)):
        if generated_at_first is None:
            generated_at_first = await server_metric(client.server_urls, "vllm:generation_tokens") - before
        chunks += 1
        tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            assert chunk.finish_reason is FinishReason.LENGTH
    assert tokens == 1500 and chunks > 10
    # The first chunk came while the servers were still sampling it: counts, not clocks (the router's
    # health probes add a token now and then, never fewer).
    assert generated_at_first < 1500, generated_at_first


async def test_leaving_the_stream_early_aborts_the_server_request(client):
    generated = await server_metric(client.server_urls, "vllm:generation_tokens")
    async with contextlib.aclosing(client.generate_stream(request(1800))) as stream:
        first = await anext(stream)
        assert first.token_ids and first.finish_reason is None

    async def idle() -> bool:
        return not await server_metric(client.server_urls, "vllm:num_requests_running")

    await wait_until(idle, "leaving the stream ends the server request", poll_s=0.02)
    assert await server_metric(client.server_urls, "vllm:generation_tokens") - generated < 1800


async def test_pause_abort_mid_stream_ends_it_with_the_partial_tokens(client):
    stream = client.generate_stream(request(1800))
    first = await anext(stream)
    await client.pause("abort")
    try:
        rest = [chunk async for chunk in stream]
    finally:
        await client.resume()
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert 0 < len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 1800


async def test_a_stream_started_while_paused_waits_for_resume(client):
    await client.pause("abort")
    try:
        task = asyncio.create_task(collect_stream(client.generate_stream(request(4))))
        await asyncio.sleep(0.3)  # a window for an answer that must not come: slowness can only hide one
        assert not task.done()  # polling the 503s of the paused servers
    finally:
        await client.resume()
    assert len((await asyncio.wait_for(task, 30)).token_ids) == 4


async def test_bad_request_raises_naming_the_url(client):
    bad = GenerateRequest([10**9], SamplingParams(max_tokens=2))
    with pytest.raises(RemoteInferenceError, match="HTTP 400") as info:
        await anext(client.generate_stream(bad))
    assert info.value.status == 400 and "/v1/completions" in str(info.value)


async def test_sse_parsing_takes_chunks_of_any_size_and_lines_of_any_length():
    from rollflow.http.sse import iter_sse

    big = {"choices": [{"token_ids": list(range(100_000))}]}  # a line far over aiohttp's readline limit
    raw = b": comment\r\n\r\n" + b"data: " + json.dumps(big).encode() + b'\r\n\r\ndata: {"a": 1}\n\n'
    raw += b'event: x\ndata: [DONE]\n\ndata: {"after": true}\n\n'

    async def chunks(size: int):
        for start in range(0, len(raw), size):
            yield raw[start : start + size]

    for size in (1, 7, 4096, len(raw)):
        assert [event async for event in iter_sse(chunks(size))] == [big, {"a": 1}]
