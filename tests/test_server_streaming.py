"""``stream: true`` on the engine server's ``/v1/completions`` and ``/v1/chat/completions``, with the official
``openai`` client and raw SSE: chunks come while the engine samples, they add up to the non-streamed answer,
errors before the stream are 4xx JSON, and a client that disconnects aborts its engine request."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import pytest_asyncio

from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer

from .helpers.waits import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir):
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer, load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    # No prefix cache, so that a streamed and a non-streamed call of one prompt compute the same numbers.
    engine = TorchEngine(
        load_causal_lm(tiny_model_dir), max_batch_size=4, max_model_len=2048, enable_prefix_caching=False
    )
    server = EngineServer(
        engine,
        tokenizer,
        served_model_name=MODEL,
        renderer=create_chat_renderer(tokenizer, ModelConfig()),
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def sse_events(response: aiohttp.ClientResponse) -> list:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


@pytest.mark.slow
async def test_completions_stream_is_incremental_and_equals_the_whole_answer(server, client):
    body = {"max_tokens": 1500, "seed": 3, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    generated_before = server.engine.total_generated_tokens
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon",
        stream=True,
        logprobs=0,
        stream_options={"include_usage": True},
        **body,
    )
    generated_at_first, running_at_first, chunks = None, None, 0
    text, token_ids, logprobs, prompt_ids, finish, usage, versions = "", [], [], None, None, None, []
    async for chunk in stream:
        chunks += 1
        if generated_at_first is None:
            generated_at_first = server.engine.total_generated_tokens - generated_before
            running_at_first = server.engine.num_running
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            extra = choice.model_extra
            token_ids += extra["token_ids"]
            versions += extra["policy_versions"]
            prompt_ids = prompt_ids or extra.get("prompt_token_ids")
            logprobs += choice.logprobs.token_logprobs
            finish = choice.finish_reason or finish
    # The first chunk came while the engine was still sampling this request, and many followed: counts, not
    # clocks (how far the engine got meanwhile depends on the machine's load).
    assert running_at_first == 1 and generated_at_first < 1500, generated_at_first
    assert chunks > 10, chunks

    whole = await client.completions.create(model=MODEL, prompt="Once upon", logprobs=0, **body)
    (choice,) = whole.choices
    assert text == choice.text
    assert token_ids == choice.model_extra["token_ids"] and len(token_ids) == 1500
    assert prompt_ids == choice.model_extra["prompt_token_ids"]
    assert logprobs == choice.logprobs.token_logprobs
    assert versions == choice.model_extra["policy_versions"]
    assert finish == choice.finish_reason == "length"
    assert usage.completion_tokens == 1500 and usage.prompt_tokens == whole.usage.prompt_tokens


async def test_chat_stream_equals_the_whole_message(server, client):
    messages = [{"role": "user", "content": "tell me a story"}]
    body = {"max_tokens": 200, "seed": 11, "logprobs": True}
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
        **body,
    )
    roles, content, finish, logprobs, token_ids, usage, prompt_ids = [], "", None, [], [], None, None
    async for chunk in stream:
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids")
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            token_ids += choice.model_extra.get("token_ids") or []
            if choice.logprobs is not None:
                logprobs += [entry.logprob for entry in choice.logprobs.content]
    whole = await client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"return_token_ids": True}, **body
    )
    (choice,) = whole.choices
    assert roles[0] == "assistant"
    assert content == choice.message.content and finish == choice.finish_reason
    assert token_ids == choice.model_extra["token_ids"]
    assert logprobs == [entry.logprob for entry in choice.logprobs.content]
    assert prompt_ids == whole.model_extra["prompt_token_ids"]
    assert usage.completion_tokens == len(token_ids) == whole.usage.completion_tokens


async def test_several_choices_stream_with_their_index(client):
    stream = await client.completions.create(
        model=MODEL, prompt=[[5, 6], [7, 8]], n=2, max_tokens=12, stream=True, seed=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    tokens: dict[int, list[int]] = {}
    finished = set()
    async for chunk in stream:
        for choice in chunk.choices:
            tokens.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3} and all(len(t) == 12 for t in tokens.values())


async def test_raw_sse_framing_and_done(server):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 5, "stream": True, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert "token_ids" not in chunks[0]["choices"][0]  # only with return_token_ids, as vLLM


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                                  "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": [5, 99999999], "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": [5], "max_tokens": 100000, "stream": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [], "stream": True}, "messages"),
        ("/v1/completions", {"prompt": [5], "n": 0, "stream": True}, "n"),
        ("/v1/completions", {"prompt": [5], "stream": True, "stream_options": {"include_usage": "x"}},
         "stream_options.include_usage"),
    ],
)  # fmt: skip
async def test_bad_stream_requests_are_400_json_before_any_event(server, path, body, param):
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json=body) as response:
        assert response.status == 400
        assert response.content_type == "application/json"
        error = (await response.json())["error"]
    assert error["param"] == param and error["code"] == "invalid_request" and error["message"]


async def test_paused_server_answers_streams_with_503_json(server, client):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/pause?mode=abort") as response:
            assert response.status == 200
        try:
            with pytest.raises(openai.InternalServerError) as raised:
                await client.completions.create(model=MODEL, prompt=[5], max_tokens=4, stream=True)
            assert raised.value.status_code == 503
        finally:
            async with http.post(f"{server.url}/resume") as response:
                assert response.status == 200


async def test_pause_abort_mid_stream_ends_it_with_abort_and_partial_tokens(server, client):
    stream = await client.completions.create(
        model=MODEL, prompt=[5, 6], max_tokens=1800, stream=True, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True},
    )  # fmt: skip
    tokens, finish = [], None
    async with aiohttp.ClientSession() as http:
        async for chunk in stream:
            tokens += chunk.choices[0].model_extra["token_ids"]
            finish = chunk.choices[0].finish_reason
            if finish is None and len(tokens) >= 3 and server.pause_mode is None:
                async with http.post(f"{server.url}/pause?mode=abort") as response:
                    assert response.status == 200
        async with http.post(f"{server.url}/resume") as response:
            assert response.status == 200
    assert finish == "abort" and 3 <= len(tokens) < 1800


async def test_client_disconnect_mid_stream_aborts_the_engine_request(server):
    engine = server.engine
    cancelled, generated = engine.num_cancelled_requests, engine.total_generated_tokens
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1800, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{server.url}/v1/completions", json=body)
        first = await response.content.readline()
        assert first.startswith(b"data: ") and engine.num_running == 1
        response.close()  # drop the connection mid-stream
    await wait_until(lambda: not engine.num_running, "the disconnect aborts the engine request")
    assert engine.num_cancelled_requests == cancelled + 1
    # The generation did not run to its end.
    assert engine.total_generated_tokens - generated < 1800


async def test_chat_stream_with_the_sync_client_in_a_thread(server):
    def agent() -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=30, seed=5, stream=True
            )
            if chunk.choices
        )
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, seed=5)
        return streamed, whole.choices[0].message.content

    streamed, whole = await asyncio.to_thread(agent)
    assert streamed == whole
