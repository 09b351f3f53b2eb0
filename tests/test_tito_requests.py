"""What OpenAI-compatible agents send, honoured exactly: stop strings (the reply ends at the token that
completes one, and exactly the tokens up to it are recorded and trained), n > 1 (sibling branches), vLLM's
sampling extras under enforced sampling, per-request ``chat_template_kwargs``, ``return_token_ids``."""

from __future__ import annotations

import asyncio

import openai
import pytest

from rollflow.tito import TITOProxy, compose
from tests.helpers.tito import (
    MODEL,
    ScriptedClient,
    ScriptedPolicy,
    assert_parity,
)

pytestmark = pytest.mark.asyncio


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


async def test_stop_string_on_the_real_engine_cuts_at_the_completing_token(
    inference_client, tiny_chat, inference_backend
):
    """Sample once without ``stop`` (seeded), pick a stretch of that reply as the stop string and sample
    again with the same seed: the reply is the same tokens up to the one that completes the stop string."""
    decode = _decode(tiny_chat.tokenizer)
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        ask = {"model": MODEL, "messages": [_user("talk")], "max_tokens": 40, "seed": 7, "temperature": 1.0}
        free = await client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
        free_ids = free.choices[0].model_extra["token_ids"]
        text = decode(free_ids)
        # A stop string that completes in the middle of the reply: the text of tokens 10..12.
        position = len(decode(free_ids[:10]))
        stop = text[position : position + max(2, len(decode(free_ids[10:12])))]
        expected = next(k for k in range(1, len(free_ids) + 1) if stop in decode(free_ids[:k]))
        assert expected < len(free_ids)
        for include in (False, True):
            stopped = await client.chat.completions.create(
                **ask,
                stop=[stop],
                extra_body={"return_token_ids": True, "include_stop_str_in_output": include},
            )
            choice = stopped.choices[0]
            assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
            assert choice.model_extra["token_ids"] == free_ids[:expected]
            assert stopped.usage.completion_tokens == expected
            cut = text[: text.find(stop) + (len(stop) if include else 0)]
            assert choice.message.content == cut.strip() if not include else cut.lstrip()
    trace = session.trace
    assert [t.options.get("stop_reason") for t in trace.turns] == [None, stop, stop]
    assert [len(t.completion_ids) for t in trace.turns] == [len(free_ids), expected, expected]
    # The engine requests end at the stop strings: closing a stream ends its engine request (over HTTP too, see
    # tests/test_stop_abort_http.py). A loaded machine may take a while to get there, so wait for it, generously.
    try:
        async with asyncio.timeout(60):
            while await inference_backend.running_requests():
                await asyncio.sleep(0.02)
    except TimeoutError:
        running = await inference_backend.running_requests()
        pytest.fail(f"{running} engine request(s) still running 60 s after stop strings ended the replies")


async def test_stop_strings_streamed_and_bridged_keep_the_sampled_tokens(tiny_chat):
    replies = ["I will look.\nObservation: it rained", "It rained.", "ok"]
    policy = ScriptedPolicy(None, tiny_chat.tokenizer, lambda call, _: replies[call])
    async with TITOProxy(policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        history = [_user("weather?")]
        stream = await client.chat.completions.create(
            model=MODEL, messages=history, stop=["Observation:", "Calling tools:"], stream=True
        )
        content, finish, stop_reason = "", None, None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                stop_reason = (choice.model_extra or {}).get("stop_reason") or stop_reason
        assert (content, finish, stop_reason) == ("I will look.", "stop", "Observation:")
        history += [{"role": "assistant", "content": content}, _user("so?")]
        second = await client.chat.completions.create(model=MODEL, messages=history, stop="Observation:")
        assert second.choices[0].message.content == "It rained."
        assert second.choices[0].model_extra["stop_reason"] is None  # ended on the model's own stop token
    trace = session.trace
    first, then = trace.turns
    assert then.render.method == "bridge"  # the history extends the recorded (cut) reply
    # The first reply ends with the tokens of "Observation:" (not "it rained", nor the stop token).
    decode = _decode(tiny_chat.tokenizer)
    assert decode(first.completion_ids).endswith("Observation:")
    assert assert_parity(trace, policy.calls, ["Observation:", "Calling tools:"], decode) == sum(
        len(t.completion_ids) for t in trace.turns
    )


async def test_n_replies_are_sibling_branches(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        response = await client.chat.completions.create(
            model=MODEL, messages=[_user("three ways")], n=3, max_tokens=12, seed=3, logprobs=True
        )
        assert [c.index for c in response.choices] == [0, 1, 2]
        picked = response.choices[1].message
        follow = [_user("three ways"), picked.model_dump(exclude_none=True), _user("more")]
        await client.chat.completions.create(model=MODEL, messages=follow, max_tokens=6)
    trace = session.trace
    assert len(trace.turns) == 4 and len({t.node.id for t in trace.turns[:3]}) == 3
    parents = {t.node.parent.id for t in trace.turns[:3]}
    assert len(parents) == 1  # one prompt, three sibling replies
    assert trace.turns[3].render.method == "bridge" and trace.turns[3].node.path()[1] == trace.turns[1].node
    samples = compose(trace, reward=1.0, max_seq_len=512)
    assert len(samples) == 3
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(t.completion_ids) for t in trace.turns)
    assert response.usage.completion_tokens == sum(len(t.completion_ids) for t in trace.turns[:3])


@pytest.mark.parametrize("enforce", [True, False])
async def test_vllm_sampling_extras(tiny_chat, enforce):
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        scripted,
        tiny_chat.renderer,
        tiny_chat.tokenizer,
        model_name=MODEL,
        default_top_k=20,
        enforce_sampling=enforce,
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        ask = {"model": MODEL, "messages": [_user("hi")]}
        await client.chat.completions.create(**ask, seed=5)
        await client.chat.completions.create(**ask, extra_body={"top_k": 5})
        extras = {"min_p": 0.1, "repetition_penalty": 1.1}
        if enforce:
            await client.chat.completions.create(**ask, extra_body=extras)
        else:
            with pytest.raises(openai.BadRequestError, match="min_p"):
                await client.chat.completions.create(**ask, extra_body=extras)
    asked = [(r.sampling.top_k, r.sampling.seed) for r in scripted.requests]
    if enforce:
        assert asked == [(20, 5), (20, None), (20, None)]
        assert session.trace.stats.sampling_overridden == 2
    else:
        assert asked == [(20, 5), (5, None)]
        assert session.trace.stats.sampling_overridden == 0


async def test_enable_thinking_per_request_is_rendered_and_recorded(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, lambda call, _: f"<think>\nhm {call}\n</think>\n\nyes")
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        history = [_user("think about it")]
        thought = await client.chat.completions.create(
            model=MODEL, messages=history, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
        )
        assert thought.choices[0].message.model_extra["reasoning_content"] == "hm 0"
        history += [thought.choices[0].message.model_dump(exclude_none=True), _user("again")]
        await client.chat.completions.create(
            model=MODEL, messages=history, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
        )
        await client.chat.completions.create(model=MODEL, messages=[_user("think about it")])
    thinking = tiny_chat.renderer_with(enable_thinking=True)
    expected = thinking.render([_user("think about it")], add_generation_prompt=True).token_ids
    assert scripted.requests[0].prompt_token_ids == expected
    plain = tiny_chat.renderer.render([_user("think about it")], add_generation_prompt=True).token_ids
    assert scripted.requests[2].prompt_token_ids == plain != expected
    turns = session.trace.turns
    assert [t.options for t in turns] == [{"chat_template_kwargs": {"enable_thinking": True}}] * 2 + [{}]
    assert turns[2].render.outcome == "forked"  # same message, other template: its own branch


async def test_return_token_ids_are_what_was_recorded(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        history = [_user("hi")]
        for _ in range(2):
            response = await client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=8, extra_body={"return_token_ids": True}
            )
            history += [response.choices[0].message.model_dump(exclude_none=True), _user("and")]
        plain = await client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    turn = session.trace.turns[1]
    assert response.model_extra["prompt_token_ids"] == turn.node.prefix_ids()[: turn.prompt_len].tolist()
    assert response.choices[0].model_extra["token_ids"] == turn.completion_ids
    assert "prompt_token_ids" not in (plain.model_extra or {})


async def test_streamed_thinking_reply_per_request(tiny_chat):
    policy = ScriptedPolicy(
        None, tiny_chat.tokenizer, lambda call, _: "<think>\nlong thought here\n</think>\n\nthe answer"
    )
    async with TITOProxy(policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[_user("think")],
            stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        content, reasoning = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    (turn,) = session.trace.turns
    assert (content, reasoning) == ("the answer", "long thought here")
    assert (turn.message["content"], turn.message["reasoning_content"]) == (content, reasoning)
    assert session.trace.stats.streams_diverged == 0
