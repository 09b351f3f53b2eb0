"""Streaming through the TITO proxy: deltas reach the agent while the engine samples, they add up to the
recorded message, the trace holds exactly the sampled tokens, and a client that leaves mid-stream aborts."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest

from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.text_deltas import TextDeltas
from rollflow.messages import GenerateChunk, GenerateRequest
from rollflow.tito import TITOProxy
from tests.helpers.tito import MODEL, ScriptedClient
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.asyncio

# With this seed and prompt the tiny model answers with hundreds of tokens (900, max_tokens, with the engine's
# sampler of 2026-12): long enough that the first delta must come long before the end if streaming is
# incremental.
LONG_SEED, LONG_PROMPT = 3, "write a long story"


class RecordingClient(LocalInferenceClient):
    """A local client that keeps every chunk it streamed, to compare with what the trace recorded."""

    def __init__(self, engines):
        super().__init__(engines)
        self.chunks: list[GenerateChunk] = []

    async def generate_stream(self, request: GenerateRequest):
        async with contextlib.aclosing(super().generate_stream(request)) as stream:
            async for chunk in stream:
                self.chunks.append(chunk)
                yield chunk


class TokenByTokenClient(ScriptedClient):
    """The scripted replies, streamed one token at a time."""

    def __init__(self, *args, step_s: float = 0.002, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_s = step_s

    async def generate_stream(self, request: GenerateRequest):
        output = await self.generate(request)
        for i, token in enumerate(output.token_ids):
            await asyncio.sleep(self.step_s)
            last = i == len(output.token_ids) - 1
            yield GenerateChunk(
                output.request_id,
                [token],
                [output.logprobs[i]],
                [output.policy_versions[i]],
                output.finish_reason if last else None,
                output.prompt_len,
            )


@pytest.fixture(scope="module")
def engine(uncached_engine):
    return uncached_engine


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.mark.local_only(reason="an engine without a prefix cache, and its running and cancelled counts")
async def test_deltas_arrive_while_sampling_and_add_up_to_the_recorded_turn(engine, tiny_chat):
    client = RecordingClient([engine])
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        stream = await agent.chat.completions.create(
            model=MODEL,
            messages=[_user(LONG_PROMPT)],
            max_tokens=900,
            seed=LONG_SEED,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
        content, finish, usage, logprobs, content_deltas = "", None, None, [], 0
        running_at_first = tokens_at_first = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    logprobs += [entry.logprob for entry in choice.logprobs.content]
                if choice.delta.content:
                    content_deltas += 1
                    if running_at_first is None:
                        running_at_first, tokens_at_first = engine.num_running, len(logprobs)
                    assert "\ufffd" not in choice.delta.content[-1:]  # no half-sampled character sent
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        (turn,) = session.trace.turns

    # Incremental: the first text came while the engine was still sampling, after a few of the tokens, and
    # many deltas followed (counts, not clocks: how fast they come depends on the machine's load).
    assert running_at_first == 1 and tokens_at_first < len(turn.completion_ids) / 4
    assert content_deltas > 10
    # Exact: the text adds up to the recorded message, the trace holds exactly the sampled tokens.
    assert content == turn.message["content"] and finish == turn.finish_reason
    sampled = [token for chunk in client.chunks for token in chunk.token_ids]
    assert turn.completion_ids == sampled and len(sampled) >= 500
    assert logprobs == turn.logprobs == [lp for chunk in client.chunks for lp in chunk.logprobs]
    assert usage.completion_tokens == len(sampled)


@pytest.mark.local_only(reason="an engine without a prefix cache, and its running and cancelled counts")
async def test_streamed_and_whole_answers_record_the_same_turn(engine, tiny_chat):
    async with TITOProxy(
        LocalInferenceClient([engine]), tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        turns, texts = [], []
        for stream in (True, False):
            session = await proxy.open_session()
            agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            request = {"model": MODEL, "messages": [_user("hi")], "max_tokens": 120, "seed": 7}
            if stream:
                chunks = await agent.chat.completions.create(**request, stream=True)
                texts.append("".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]))
            else:
                texts.append((await agent.chat.completions.create(**request)).choices[0].message.content)
            turns.append((await proxy.close_session(session)).turns[0])
    assert texts[0] == texts[1]
    assert turns[0].completion_ids == turns[1].completion_ids and turns[0].logprobs == turns[1].logprobs
    assert turns[0].message["content"] == turns[1].message["content"]


@pytest.mark.parametrize("thinking", [False, True])
async def test_multibyte_text_reasoning_and_tool_calls_stream_exactly(tiny_chat, thinking):
    def reply(call: int, request) -> str:
        think = "<think>\n思考 step é\n</think>\n\n" if thinking else ""
        if call == 0:
            return think + "漢字 and é — naïve café 🙂 done"
        return think + 'calling 🙂 <tool_call>\n{"name": "add", "arguments": {"n": 1}}\n</tool_call>'

    renderer = tiny_chat.renderer_with(enable_thinking=True) if thinking else tiny_chat.renderer
    # 20 ms a token: the proxy sends what was sampled since its last parse (it backs off by a multiple of the
    # parse's time), so tokens far apart keep the count of deltas from depending on the machine's load.
    scripted = TokenByTokenClient(tiny_chat.tokenizer, reply, step_s=0.02)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    async with TITOProxy(scripted, renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        for _ in range(2):
            stream = await agent.chat.completions.create(
                model=MODEL, messages=[_user("hi")], tools=tools, stream=True
            )
            chunks = [chunk async for chunk in stream]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            content = "".join(d.content or "" for d in deltas)
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            calls = [(i, d.tool_calls) for i, d in enumerate(deltas) if d.tool_calls]
            turn = session.trace.turns[-1]
            assert content == turn.message["content"]
            assert reasoning == (turn.message.get("reasoning_content") or "")
            assert not any("\ufffd" in (d.content or "") for d in deltas)
            if turn.message.get("tool_calls"):
                assert len(deltas) >= 3  # the text before the call in pieces of its own, then the call
                # Tool calls come whole, in the last chunk, with the finish reason.
                ((index, (call,)),) = calls
                assert index == len(deltas) - 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
                assert call.function.name == "add" and json.loads(call.function.arguments) == {"n": 1}
            else:
                assert len(deltas) > 5  # many deltas, not one blob
                assert not calls
        assert [bool(t.message.get("tool_calls")) for t in session.trace.turns] == [False, True]


@pytest.mark.local_only(reason="an engine without a prefix cache, and its running and cancelled counts")
async def test_client_disconnect_mid_stream_aborts_the_engine_request(engine, tiny_chat):
    async with TITOProxy(
        LocalInferenceClient([engine]), tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        cancelled = engine.num_cancelled_requests
        body = {"model": MODEL, "messages": [_user(LONG_PROMPT)], "max_tokens": 900, "seed": LONG_SEED,
                "stream": True}  # fmt: skip
        async with aiohttp.ClientSession() as http:
            response = await http.post(f"{session.base_url}/chat/completions", json=body)
            assert response.status == 200
            await response.content.readline()  # the role chunk
            assert engine.num_running == 1
            response.close()
        await wait_until(lambda: not engine.num_running, "the disconnect aborts the engine request")
        assert engine.num_cancelled_requests == cancelled + 1
        await asyncio.sleep(0.05)  # a window for a turn that must not be recorded: slowness can only hide one
        assert session.trace.turns == []


async def test_streamed_retry_replays_the_recorded_turn(tiny_chat):
    scripted = TokenByTokenClient(tiny_chat.tokenizer, lambda call, request: f"reply number {call}")
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        texts, ids = [], []
        for _ in range(2):
            stream = await agent.chat.completions.create(
                model=MODEL, messages=[_user("hi")], stream=True, extra_headers={"Idempotency-Key": "k"}
            )
            chunks = [c async for c in stream]
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            ids.append({c.id for c in chunks})
        assert texts == ["reply number 0"] * 2 and ids[0] == ids[1] == {session.trace.turns[0].response_id}
        assert len(scripted.requests) == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"stream_options": {"include_usage": True}}, "stream_options"), ({"stream": True, "n": 2}, "n")],
)
async def test_bad_stream_requests_are_400_naming_the_field(tiny_chat, fields, param):
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        body = {"model": MODEL, "messages": [_user("hi")], **fields}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{session.base_url}/chat/completions", json=body) as response,
        ):
            assert response.status == 400 and response.content_type == "application/json"
            assert (await response.json())["error"]["param"] == param
        assert scripted.requests == []


async def test_text_deltas_hold_back_half_sampled_characters(tiny_chat):
    tokenizer = tiny_chat.tokenizer
    text = "漢字 é 🙂 end  "
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = TextDeltas()
    sent = [deltas.update(tokenizer.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    sent.append(deltas.update(tokenizer.decode(ids), final=True))
    assert "".join(sent) == text and not any("\ufffd" in piece for piece in sent)
    assert len([piece for piece in sent if piece]) > 5 and not deltas.diverged

    stripped = TextDeltas(strip=True)
    assert stripped.update("a ") == "a" and stripped.update("a b") == " b"
    assert stripped.update("x", final=True) == "" and stripped.diverged


async def test_incremental_decoder_sends_stable_text_from_a_short_window(tiny_chat):
    from rollflow.inference.text_deltas import IncrementalDecoder

    tokenizer = tiny_chat.tokenizer
    text = "漢字 é 🙂 end  " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded_lengths = []

    def decode(token_ids: list[int]) -> str:
        decoded_lengths.append(len(token_ids))
        return tokenizer.decode(token_ids)

    decoder = IncrementalDecoder(decode)
    sent = [decoder.update(ids[:k]) for k in range(1, len(ids) + 1)]
    assert not any("\ufffd" in piece for piece in sent) and len([p for p in sent if p]) > 40
    assert max(decoded_lengths) < 10  # windows, not the whole text (len(ids) tokens) each time
    sent.append(decoder.finish(ids))
    assert "".join(sent) == text and not decoder.diverged


@pytest.mark.local_only(reason="pauses the engine mid-stream (a private, uncached one)")
async def test_a_pause_for_weights_mid_stream_continues_the_reply_exactly(engine, tiny_chat):
    # An engine abort (pause for a weight update) ends the engine request with its partial tokens; the
    # session resubmits from them once resumed, and the agent's stream just goes on.
    client = RecordingClient([engine])
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        stream = await agent.chat.completions.create(
            model=MODEL,
            messages=[_user(LONG_PROMPT)],
            max_tokens=900,
            seed=LONG_SEED,
            stream=True,
            logprobs=True,
        )
        content, logprobs, paused = "", [], False
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                logprobs += [entry.logprob for entry in (choice.logprobs.content if choice.logprobs else [])]
                if not paused and choice.delta.content:
                    paused = True
                    await engine.pause("abort")
                    await asyncio.sleep(0.05)
                    await engine.resume()
        (turn,) = session.trace.turns
    finishes = [chunk.finish_reason for chunk in client.chunks if chunk.finish_reason is not None]
    assert finishes[0].value == "abort" and len(finishes) == 2  # one resubmission
    assert content == turn.message["content"] and logprobs == turn.logprobs
    assert turn.completion_ids == [token for chunk in client.chunks for token in chunk.token_ids]


async def test_a_streamed_retry_joins_the_attempt_in_flight_and_catches_up(tiny_chat):
    scripted = TokenByTokenClient(
        tiny_chat.tokenizer, lambda call, request: "a fairly long reply, " * 8, step_s=0.005
    )
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)

        streaming = asyncio.Event()  # the first attempt's text has begun to arrive

        async def attempt(after: asyncio.Event | None) -> str:
            if after is not None:
                await asyncio.wait_for(after.wait(), 60)
            stream = await agent.chat.completions.create(
                model=MODEL, messages=[_user("hi")], stream=True, extra_headers={"Idempotency-Key": "same"}
            )
            text = ""
            async for chunk in stream:
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                if text:
                    streaming.set()
            return text

        # The retry comes while the first attempt streams (not after a guessed delay).
        first, joined = await asyncio.gather(attempt(None), attempt(streaming))
        (turn,) = session.trace.turns
    assert first == joined == turn.message["content"] and len(scripted.requests) == 1


async def test_a_streamed_reply_that_differs_from_the_record_is_counted(tiny_chat):
    """Were a parser to re-read text it already gave (say, a late end of reasoning), the agent's streamed
    copy would differ from the recorded message: such turns are counted, not only logged."""
    import dataclasses

    scripted = TokenByTokenClient(tiny_chat.tokenizer, lambda call, request: f"answer number {call} here")
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)

        async def ask() -> str:
            stream = await agent.chat.completions.create(model=MODEL, messages=[_user("hi")], stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        assert await ask() == session.trace.turns[-1].message["content"]
        assert session.trace.stats.streams_diverged == 0

        parse, stop = proxy.renderer.parse, scripted.stop_token_id

        def rereading_parse(completion_ids, tools, prompt_ids):
            parsed = parse(completion_ids, tools, prompt_ids)
            if completion_ids and completion_ids[-1] != stop:  # mid-reply: text the end will not keep
                parsed = dataclasses.replace(parsed, content="draft: " + parsed.content)
            return parsed

        proxy.renderer.parse = rereading_parse
        assert (await ask()).startswith("draft: ")
        assert session.trace.stats.streams_diverged == 1
