"""The proxy end to end with the official ``openai`` client (sync and async, streamed and not) and litellm,
over the tiny model in the suite's inference mode (``inference_client``); plus retries, concurrency,
disconnects and clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import anyio
import openai
import pytest

from rollflow.tito import TITOProxy, compose
from tests.helpers.tito import MODEL, ScriptedClient
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def proxy(inference_client, tiny_chat):
    async with TITOProxy(inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as p:
        yield p


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_async_client_multi_turn_bridges_and_records_exact_tokens(proxy, inference_backend):
    session = await proxy.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, _user("hello")]
    for turn in range(3):
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=turn, logprobs=True
        )
        choice = response.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert response.usage.completion_tokens == len(choice.logprobs.content)
        messages += [choice.message.model_dump(exclude_none=True), _user(f"more {turn}")]
    trace = await proxy.close_session(session)
    assert [t.render.method for t in trace.turns] == ["full", "bridge", "bridge"]
    recorded = trace.turns[-1]
    assert [c.logprob for c in choice.logprobs.content] == recorded.logprobs
    (sample,) = compose(trace, reward=1.0, max_seq_len=512)
    assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in trace.turns)
    assert session.session_id

    async def idle() -> bool:  # waited for: over HTTP the router's health probes are 1-token generations
        return not await inference_backend.running_requests()

    await wait_until(idle, "no engine request is left running after the session")


async def test_each_later_turn_of_a_session_reuses_its_cached_prefix(proxy, inference_backend):
    """A later turn's prompt extends the earlier prompt and reply token for token, and the engine that
    served the session still holds their keys and values: at least the whole previous prompt comes from its
    prefix cache. Over HTTP that needs the router to keep each session on one server (requests without a
    session alternate between the two)."""
    for index in range(2):
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages = [_user(f"session {index} of a prefix test: count to ten")]
        previous_prompt = 0
        for turn in range(4):
            hits_before = await inference_backend.prefix_cache_hit_tokens()
            response = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, seed=turn
            )
            hits = await inference_backend.prefix_cache_hit_tokens() - hits_before
            assert hits >= previous_prompt, f"session {index} turn {turn}: {hits} cached prompt tokens"
            previous_prompt = response.usage.prompt_tokens
            messages += [response.choices[0].message.model_dump(exclude_none=True), _user(f"and {turn}")]
        await proxy.close_session(session)


async def test_streaming_gives_the_same_message_as_the_recorded_turn(proxy):
    session = await proxy.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[_user("tell a story")],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    content, finish, usage, logprobs = "", None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                logprobs += [c.logprob for c in choice.logprobs.content]
    (turn,) = session.trace.turns
    assert content == turn.message["content"]
    assert finish == turn.finish_reason
    assert usage.completion_tokens == len(turn.completion_ids) == len(logprobs)
    assert logprobs == turn.logprobs


async def test_sync_client_in_a_thread(proxy):
    session = await proxy.open_session()

    def agent() -> tuple[str, str]:
        client = openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        # Seeded, as every reply whose tree shape is asserted: a rare unseeded reply that opens reasoning and
        # stops inside it renders differently as history, and its next turn cannot bridge.
        first = client.chat.completions.create(model=MODEL, messages=[_user("hi")], max_tokens=8, seed=1)
        history = [_user("hi"), first.choices[0].message.model_dump(), _user("and?")]
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=8, stream=True, seed=2
            )
            if chunk.choices
        )
        return first.choices[0].message.content, streamed

    first, streamed = await asyncio.to_thread(agent)
    trace = await proxy.close_session(session)
    assert [t.message["content"] for t in trace.turns] == [first, streamed]
    assert trace.turns[1].render.method == "bridge"


async def test_litellm_client(proxy):
    litellm = pytest.importorskip("litellm")
    session = await proxy.open_session()
    response = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=session.base_url,
        api_key="unused",
        messages=[_user("hi")],
        max_tokens=8,
    )
    history = [
        _user("hi"),
        {"role": "assistant", "content": response.choices[0].message.content},
        _user("go on"),
    ]
    stream = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=session.base_url,
        api_key="unused",
        messages=history,
        max_tokens=8,
        stream=True,
    )
    streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    trace = await proxy.close_session(session)
    assert [t.message["content"] for t in trace.turns] == [response.choices[0].message.content, streamed]


async def test_sdk_retry_and_idempotency_key_replay_without_sampling(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        url = f"{session.base_url}/chat/completions"
        body = json.dumps({"model": MODEL, "messages": [_user("hi")]})
        async with aiohttp.ClientSession() as http:

            async def post(headers: dict) -> dict:
                async with http.post(url, data=body, headers=headers) as response:
                    assert response.status == 200
                    return await response.json()

            first = await post({"x-stainless-retry-count": "0"})
            retried = await post({"x-stainless-retry-count": "1"})
            repeated = await post({"x-stainless-retry-count": "0"})  # a new request with the same body
            keyed = await post({"Idempotency-Key": "k1"})
            keyed_again = await post({"Idempotency-Key": "k1"})
        assert retried == first and repeated["id"] != first["id"]
        assert keyed_again == keyed and keyed["id"] != repeated["id"]
        assert len(scripted.requests) == 3
        assert session.trace.stats.replayed == 2


async def test_retry_joins_the_attempt_in_flight(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, delay_s=0.3)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        request = {"model": MODEL, "messages": [_user("hi")]}
        headers = {"Idempotency-Key": "same"}
        first, second = await asyncio.gather(
            client.chat.completions.create(**request, extra_headers=headers),
            client.chat.completions.create(**request, extra_headers=headers),
        )
        assert first.id == second.id and len(scripted.requests) == 1


async def test_concurrent_requests_into_one_session(proxy):
    session = await proxy.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    opening = await client.chat.completions.create(
        model=MODEL, messages=[_user("plan")], max_tokens=6, seed=100
    )
    base = [_user("plan"), opening.choices[0].message.model_dump(exclude_none=True)]
    # Eight subagents continue the same history at once, half with the same new message.
    responses = await asyncio.gather(
        *[
            client.chat.completions.create(
                model=MODEL, messages=[*base, _user(f"task {i % 2}")], max_tokens=6, seed=i
            )
            for i in range(8)
        ]
    )
    trace = await proxy.close_session(session)
    assert len(trace.turns) == 9 and {r.id for r in responses} == {t.response_id for t in trace.turns[1:]}
    opening_node = trace.turns[0].node
    # The two distinct follow-up messages each became one node under the opening turn.
    assert len(opening_node.children) == 2
    assert all(t.render.method == "bridge" for t in trace.turns[1:])
    samples = compose(trace, reward=1.0, max_seq_len=512)
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(t.completion_ids) for t in trace.turns)


async def test_client_disconnect_aborts_the_engine_request(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, delay_s=30)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)

        async def leave(stream: bool) -> None:
            """A client that disconnects while its request waits on the engine."""
            sent = len(scripted.requests)
            call = asyncio.ensure_future(
                client.chat.completions.create(model=MODEL, messages=[_user("hi")], stream=stream)
            )
            await wait_until(lambda: len(scripted.requests) > sent, "the request reaches the engine")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

        await leave(stream=False)
        await leave(stream=True)
        await wait_until(lambda: scripted.cancelled == 2, "the disconnects cancel both engine requests")
        assert session.trace.turns == []


async def test_client_disconnect_frees_the_real_engine_slot(proxy, inference_backend):
    session = await proxy.open_session()
    request = {
        "model": MODEL,
        "messages": [_user("write a long text")],
        "max_tokens": 480,
        "temperature": 1.0,
    }
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(f"{session.base_url}/chat/completions", json=request))
        await wait_until(inference_backend.running_requests, "the request is running on the engine")
        task.cancel()

    async def idle() -> bool:
        return not await inference_backend.running_requests()

    await wait_until(idle, "the disconnect frees the engine slot")
    assert session.trace.turns == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_start_stop_100_times_leaks_no_sockets_or_tasks(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer)
    body = {"model": MODEL, "messages": [_user("hi")]}

    async def cycle(with_request: bool) -> None:
        async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
            session = await proxy.open_session()
            if with_request:
                url = f"{session.base_url}/chat/completions"
                async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
                    assert response.status == 200

    await cycle(True)  # warm up lazily created resources
    fds, tasks = _open_fds(), len(asyncio.all_tasks())
    for i in range(100):
        await cycle(with_request=i % 10 == 0)
    await asyncio.sleep(0)
    assert _open_fds() <= fds
    assert len(asyncio.all_tasks()) == tasks


async def test_close_session_drains_then_cancels_stragglers(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, delay_s=0.2)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        call = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=[_user("hi")]))
        with anyio.fail_after(30):  # the call is in flight (a loaded machine may take a while to get there)
            while not scripted.requests:
                await asyncio.sleep(0.01)
        trace = await proxy.close_session(session)  # waits for the call in flight
        assert len(trace.turns) == 1 and (await call).id == trace.turns[0].response_id

        scripted.delay_s = 30
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        call = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=[_user("hi")]))
        with anyio.fail_after(30):  # the call is in flight (a loaded machine may take a while to get there)
            while len(scripted.requests) < 2:
                await asyncio.sleep(0.01)
        trace = await proxy.close_session(session, drain_timeout_s=0.1)
        assert trace.turns == [] and scripted.cancelled == 1
        with pytest.raises(openai.ConflictError, match="closed during the request") as caught:
            await call
        # The agent is not shown the session's admin id.
        assert session.session_id not in str(caught.value)
        with pytest.raises(openai.ConflictError) as again:
            await client.chat.completions.create(model=MODEL, messages=[_user("hi")])
        assert session.session_id not in str(again.value)


@pytest.mark.parametrize("enforce", [True, False])
async def test_the_runs_sampling_settings_win_when_enforced(tiny_chat, enforce):
    """Training needs every token sampled at the run's temperature and top_p (the PPO ratio assumes them):
    an agent's own are overridden and counted; with enforcement off they are honoured."""
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        scripted,
        tiny_chat.renderer,
        tiny_chat.tokenizer,
        model_name=MODEL,
        default_temperature=0.9,
        default_top_p=0.95,
        enforce_sampling=enforce,
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused") as client:
            messages = [_user("hi")]
            await client.chat.completions.create(model=MODEL, messages=messages)
            await client.chat.completions.create(model=MODEL, messages=messages, temperature=0.9)
            await client.chat.completions.create(model=MODEL, messages=messages, temperature=0.3, top_p=0.5)
    asked = [(r.sampling.temperature, r.sampling.top_p) for r in scripted.requests]
    if enforce:
        assert asked == [(0.9, 0.95)] * 3
        assert session.trace.stats.sampling_overridden == 1  # only the request that asked for others
    else:
        assert asked == [(0.9, 0.95), (0.9, 0.95), (0.3, 0.5)]
        assert session.trace.stats.sampling_overridden == 0


async def test_sampling_values_the_engines_cannot_honour_are_a_400_naming_the_field(tiny_chat):
    """With enforcement off an agent's own values reach the engines, which every session shares: one the
    float32 sampler cannot represent is refused before anything is rendered or sampled."""
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, enforce_sampling=False
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            messages = [_user("hi")]
            for fields, param in [({"temperature": 1e-300}, "temperature"), ({"top_p": 1e-300}, "top_p")]:
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(model=MODEL, messages=messages, **fields)
                assert info.value.body["param"] == param, info.value.body
            await client.chat.completions.create(model=MODEL, messages=messages, temperature=1e-5)
    assert [r.sampling.temperature for r in scripted.requests] == [1e-5]
