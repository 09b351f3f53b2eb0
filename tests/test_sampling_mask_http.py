"""Sampling masks and logprob modes over HTTP: real ``rollflow serve`` servers, the remote client, and the
start-up check that rejects a server reporting vLLM's default raw logprobs."""

from __future__ import annotations

import json
import math

import aiohttp
import pytest
import pytest_asyncio

from rollflow.errors import ConfigError
from rollflow.inference.client import collect_stream
from rollflow.inference.logprob_check import check_server_logprobs, logprob_problem
from rollflow.inference.remote import RemoteInferenceClient, RemoteInferenceError
from rollflow.inference.remote_wire import kept_counts
from rollflow.launch.server_group import ServerGroup
from rollflow.messages import GenerateRequest, SamplingParams

module_loop = pytest.mark.asyncio(loop_scope="module")

TRUNCATED = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, top_k=40, seed=11)


@pytest_asyncio.fixture(loop_scope="module")
async def client(inference_servers):
    url = inference_servers.urls[0]
    async with RemoteInferenceClient(url, [url], control_timeout_s=30, request_timeout_s=60) as client:
        yield client


@module_loop
async def test_generate_and_stream_carry_the_kept_counts(client):
    request = GenerateRequest([5, 6, 7], TRUNCATED)
    output = await client.generate(request)
    assert output.kept_counts is not None and len(output.kept_counts) == len(output.token_ids) == 6
    assert all(1 <= count <= 40 for count in output.kept_counts)
    streamed = await collect_stream(client.generate_stream(request))
    assert streamed.token_ids == output.token_ids
    assert streamed.kept_counts == output.kept_counts
    plain = await client.generate(GenerateRequest([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.7)))
    assert plain.kept_counts is None


@module_loop
async def test_chat_completions_carry_the_kept_counts(inference_servers):
    url = inference_servers.urls[0]
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.7,
        "top_k": 3,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            choice = (await response.json())["choices"][0]
        assert choice["kept_counts"] == [3] * 5
        async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
            text = await response.text()
    streamed = [
        count
        for line in text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:]).get("choices", [])
        for count in choice.get("kept_counts", [])
    ]
    assert streamed == [3] * 5


def test_client_refuses_malformed_kept_counts_and_fills_vllms_top_k():
    params = SamplingParams(top_k=20)
    with pytest.raises(
        RemoteInferenceError, match="kept_counts from http://s must be one integer >= 0 per token"
    ):
        kept_counts({"kept_counts": [3]}, 2, params, "http://s")
    with pytest.raises(RemoteInferenceError, match="kept_counts"):
        kept_counts({"kept_counts": [3, -1]}, 2, params, "http://s")
    # vLLM records no kept sets: top-k alone keeps k tokens; top-p cannot be rebuilt.
    assert kept_counts({}, 2, params, "http://s") == [20, 20]
    assert kept_counts({}, 2, SamplingParams(top_k=20, top_p=0.9), "http://s") is None


# ---------------------------------------------------------------- the start-up check


@module_loop
async def test_rollflows_server_passes_the_logprob_check(inference_servers):
    await check_server_logprobs(inference_servers.urls, 0.7)
    await check_server_logprobs(inference_servers.urls[:1], 1.0)


@pytest.mark.slow
@module_loop
async def test_a_server_with_raw_logprobs_is_rejected_naming_the_flag(tmp_path):
    """``rollflow serve --logprobs-mode raw_logprobs`` returns what vLLM returns without the flag."""
    group = ServerGroup(
        "rollflow:tiny",
        1,
        tmp_path,
        startup_timeout_s=180,
        server_options={"extra_args": ["--logprobs-mode", "raw_logprobs"]},
    )
    async with group:
        for temperature in (0.7, 1.0):
            with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs") as caught:
                await check_server_logprobs(group.urls, temperature)
            assert group.urls[0] in str(caught.value) and "sum to" in str(caught.value)


def test_logprob_problem_on_hand_made_draws():
    """The verdicts on draws written by hand: processed, raw, untempered-but-renormalised, one token."""
    gap_1 = 0.6  # lp_1(a) - lp_1(b)

    def pair(gap: float) -> dict[int, float]:
        # Two renormalised logprobs with the given gap.
        return {0: -math.log1p(math.exp(-gap)), 1: -math.log1p(math.exp(gap))}

    assert logprob_problem({0.5: pair(gap_1 / 0.5), 1.0: pair(gap_1)}) is None
    assert "sum to" in logprob_problem({0.5: {0: -2.0, 1: -2.6}, 1.0: {0: -2.0, 1: -2.6}})
    untempered = logprob_problem({0.5: pair(gap_1), 1.0: pair(gap_1)})
    assert "temperature 0.5" in untempered and "1.2000" in untempered
    assert logprob_problem({0.5: {0: -0.01}, 1.0: pair(gap_1)}) == "inconclusive"
