"""A stream left early over HTTP ends its engine request on the server, on each path a data-plane request
takes: straight to a ``rollflow serve`` server, through the router's front (session in ``X-Session-ID``) and
through the router's aiohttp path (no session header: the connection is handed to aiohttp).

A stop string relies on this: the TITO session reads the engine stream until a stop string completes, then
closes it (``collect_stream`` with ``stop_at``). Were the close not to reach the engine, every stopped turn
would go on decoding to ``max_tokens``. The checks do not depend on timing: once no request runs any more
(waited for with a generous deadline), the servers' generated-token counter must have grown by less than a
request that was not aborted adds on its own (``max_tokens``, or the whole seeded reply)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest
import pytest_asyncio

from rollflow.inference.client import collect_stream
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import InferenceRouter
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams
from rollflow.tito import TITOProxy
from rollflow.tito.testing import load_tiny_chat

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="the stream's close crossing HTTP hops to the engine server"),
]

# Within the tiny model's 2048 positions, and seconds of decoding on a CPU: a missed abort cannot hide.
MAX_TOKENS = 1500
IDLE_TIMEOUT_S = 120.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(inference_servers):
    async with InferenceRouter(inference_servers.urls, health_check_interval_s=0.5) as router:
        yield router


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    return load_tiny_chat(tiny_model_dir)


async def _metric(urls: list[str], name: str) -> float:
    """The sum over the servers of the Prometheus sample ``name`` (or ``name_total``)."""
    total = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith((f"{name}{{", f"{name}_total{{")):
                        total += float(line.rsplit(" ", 1)[1])
    return total


async def _until_no_request_runs(urls: list[str]) -> None:
    try:
        async with asyncio.timeout(IDLE_TIMEOUT_S):
            while await _metric(urls, "vllm:num_requests_running"):
                await asyncio.sleep(0.02)
    except TimeoutError:
        running = await _metric(urls, "vllm:num_requests_running")
        pytest.fail(
            f"{running:g} engine request(s) still running {IDLE_TIMEOUT_S:g} s after the stream was left"
        )


@pytest.mark.parametrize("path", ["server", "router front", "router aiohttp"])
async def test_a_stream_left_at_a_stop_ends_its_engine_request(router, inference_servers, path):
    urls = inference_servers.urls
    data_url = urls[0] if path == "server" else router.url
    # The router's front serves a request naming its session in the header; aiohttp serves the others.
    session_id = "stop-abort" if path == "router front" else None

    # Seeded: the same reply, run to the end, must reach max_tokens, or a reply that ended at the model's stop
    # token would pass whether or not the abort reached the engine.
    request = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=MAX_TOKENS, seed=0), session_id=session_id)

    async with RemoteInferenceClient(data_url, urls, control_timeout_s=30, request_timeout_s=120) as client:
        # Also warms the kept-alive connections on each hop that the stream below then reuses.
        free = await client.generate(request)
        assert len(free.token_ids) == MAX_TOKENS, (
            f"the seeded reply has {len(free.token_ids)} tokens, not max_tokens: too few to tell an abort"
        )
        generated = await _metric(urls, "vllm:generation_tokens")
        async with contextlib.aclosing(client.generate_stream(request)) as chunks:
            # A stop string that completes at the first token: the stream is left there, as TITO does.
            output = await collect_stream(chunks, stop_at=lambda chunk: 1 if chunk.token_ids else None)
        assert output.finish_reason is FinishReason.STOP and len(output.token_ids) == 1
        await _until_no_request_runs(urls)
        added = await _metric(urls, "vllm:generation_tokens") - generated
    assert added < MAX_TOKENS, (
        f"the servers generated {added:g} tokens after the stream was left at its first token, not fewer than "
        f"max_tokens ({MAX_TOKENS}): the engine request was not aborted and decoded to max_tokens"
    )


async def test_a_tito_stop_string_ends_the_engine_request_behind_the_router(router, inference_servers, chat):
    """The case above as it happens: an agent's request with a stop string, through the TITO proxy and the
    router's front (TITO names the session in the header). The engine request also ends at the model's stop
    token, so the bound is the length of the same seeded reply without the stop string: a seed whose reply runs
    to ``max_tokens``, seconds of decoding (a 201-token one ended on its own before the abort reached the engine
    on a busy machine)."""
    urls = inference_servers.urls
    decode = lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ask = {
        "model": "rollflow:tiny",
        "messages": [{"role": "user", "content": "talk"}],
        "max_tokens": MAX_TOKENS,
        "seed": 3,
        "extra_body": {"return_token_ids": True},
    }
    async with (
        RemoteInferenceClient(router.url, urls, control_timeout_s=30, request_timeout_s=120) as client,
        TITOProxy(client, chat.renderer, chat.tokenizer, model_name="rollflow:tiny") as proxy,
    ):
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        # Both replies computed from scratch (a prefix-cache hit changes logprobs in the last bits): the same
        # seed then samples the same tokens.
        await client.reset_prefix_cache()
        free = await agent.chat.completions.create(**ask)
        free_ids = free.choices[0].model_extra["token_ids"]
        assert len(free_ids) == MAX_TOKENS, (
            f"the seeded reply has {len(free_ids)} tokens: too few to tell an abort"
        )
        # A stop string that completes within the first tokens: the text of tokens 3..5.
        stop = decode(free_ids)[len(decode(free_ids[:3])) :][:3]
        await client.reset_prefix_cache()
        generated = await _metric(urls, "vllm:generation_tokens")
        stopped = await agent.chat.completions.create(**ask, stop=[stop])
        choice = stopped.choices[0]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
        assert choice.model_extra["token_ids"] == free_ids[: len(choice.model_extra["token_ids"])]
        await _until_no_request_runs(urls)
        added = await _metric(urls, "vllm:generation_tokens") - generated
    assert added < len(free_ids), (
        f"the servers generated {added:g} tokens for a reply a stop string cut after "
        f"{len(choice.model_extra['token_ids'])}, not fewer than the {len(free_ids)} of the whole reply: the "
        "engine request was not aborted"
    )
