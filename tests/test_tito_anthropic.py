"""The Anthropic Messages API on a session URL, driven by the official anthropic SDK: real tiny-model turns
recorded with exact tokens (logprobs recomputed), streamed and not, tools and signed thinking blocks read
back as the recorded turn, count_tokens equal to the prompt sampled next, a Chat Completions turn sharing
the branch, and bad input answered in Anthropic's error shape while the session stays usable."""

from __future__ import annotations

import openai
import pytest

from rollflow.tito import TITOProxy
from tests.helpers.posts import post_json
from tests.helpers.tito import (
    ADD_PARAMETERS,
    MODEL,
    ScriptedClient,
    ScriptedPolicy,
    assert_logprobs_recomputed,
    assert_parity,
    scripted_tito_proxy,
    tool_call_text,
)

pytestmark = pytest.mark.asyncio

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_PARAMETERS,
}


def _agent(session):
    """The anthropic SDK pointed at the session."""
    import anthropic  # here, not at the top: ~2 s in every collecting worker

    return anthropic.AsyncAnthropic(
        base_url=session.base_url.removesuffix("/v1"), api_key="unused", max_retries=0
    )


def _sent_back(message) -> dict:
    return {
        "role": "assistant",
        "content": [block.model_dump(exclude_none=True) for block in message.content],
    }


@pytest.mark.slow
async def test_real_turns_streamed_and_not_share_the_tree_with_chat_completions(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        async with _agent(session) as agent:
            messages = [{"role": "user", "content": "name a fruit"}]
            # Seeded, both: about one unseeded 8-token reply in 40 is thinking only, without the text block
            # the checks below read.
            seeded = {"extra_body": {"seed": 0}}
            first = await agent.messages.create(
                model=MODEL, system="answer", messages=messages, max_tokens=8, **seeded
            )
            messages += [_sent_back(first), {"role": "user", "content": "another"}]
            counted = await agent.messages.count_tokens(model=MODEL, system="answer", messages=messages)
            events = []
            async with agent.messages.stream(
                model=MODEL, system="answer", messages=messages, max_tokens=8, **seeded
            ) as stream:
                async for event in stream:
                    events.append(event.type)
                second = await stream.get_final_message()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            text = [{"role": "assistant", "content": m.content[0].text} for m in (first, second)]
            history = [
                {"role": "system", "content": "answer"},
                {"role": "user", "content": "name a fruit"},
                text[0],
                {"role": "user", "content": "another"},
                text[1],
                {"role": "user", "content": "thanks"},
            ]
            await client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
        trace = await proxy.close_session(session)

    turns = trace.turns
    assert [t.render.method for t in turns] == ["full", "bridge", "bridge"] and len(trace.leaves()) == 1
    assert counted.input_tokens == turns[1].prompt_len
    for message, turn in zip((first, second), turns, strict=False):
        assert message.id.startswith("msg_") and message.content[0].text == turn.message["content"]
        assert (message.usage.input_tokens, message.usage.output_tokens) == (
            turn.prompt_len,
            len(turn.completion_ids),
        )
        assert message.stop_reason == ("max_tokens" if turn.finish_reason == "length" else "end_turn")
    assert events[0] == "message_start" and events[-1] == "message_stop" and "text" in events
    assert assert_logprobs_recomputed(trace, tiny_chat.model_dir) == 2 * sum(
        len(t.completion_ids) for t in turns
    )


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_tool_episode_with_thinking_trains_exactly_the_sampled_tokens(
    inference_client, tiny_chat, stream
):
    reasoned = tiny_chat.renderer_with(enable_thinking=True)
    script = {0: "<think>\nadd them\n</think>\n\n" + tool_call_text("add", a=2, b=3), 1: "five\n\nEND more"}
    policy = ScriptedPolicy(inference_client, tiny_chat.tokenizer, lambda call, _: script.get(call))
    async with TITOProxy(policy, reasoned, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        async with _agent(session) as agent:

            async def create(messages, **fields):
                request = dict(model=MODEL, max_tokens=48, tools=[ADD], messages=messages, **fields)
                if not stream:
                    return await agent.messages.create(**request)
                async with agent.messages.stream(**request) as events:
                    async for _ in events:
                        pass
                    return await events.get_final_message()

            messages = [{"role": "user", "content": "add 2 and 3"}]
            first = await create(messages, thinking={"type": "enabled", "budget_tokens": 1024})
            thinking, use = first.content
            result = {
                "type": "tool_result",
                "tool_use_id": use.id,
                "content": [{"type": "text", "text": "5"}],
            }
            messages += [_sent_back(first), {"role": "user", "content": [result]}]
            second = await create(messages, thinking={"type": "enabled"}, stop_sequences=["END"])
        trace = await proxy.close_session(session)

    assert (thinking.type, thinking.thinking) == ("thinking", "add them") and thinking.signature
    assert (use.type, use.name, use.input) == ("tool_use", "add", {"a": 2, "b": 3})
    assert first.stop_reason == "tool_use"
    assert (second.stop_reason, second.stop_sequence, second.content[0].text) == (
        "stop_sequence",
        "END",
        "five",
    )
    turns = trace.turns
    assert [t.render.method for t in turns] == ["full", "bridge"]  # the blocks read back as the recorded turn
    assert trace.ignored == {"thinking.budget_tokens": 1}
    trained = assert_parity(trace, policy.calls, stops=["END"], decode=tiny_chat.tokenizer.decode)
    assert trained == sum(len(t.completion_ids) for t in turns)


@pytest.fixture
async def scripted_proxy(tiny_chat):
    async with scripted_tito_proxy(tiny_chat) as proxy:
        yield proxy


GOOD = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
ASSISTANT_CALL = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
}


async def test_claude_code_shapes_are_accepted(scripted_proxy, tiny_chat):
    """Claude Code 2.1 sends system messages inside the conversation and ``thinking: {"type": "adaptive"}``:
    a system turn where it stands, and the template's own thinking default."""
    session = await scripted_proxy.open_session()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "agents: none"}]},
        {"role": "user", "content": "go"},
    ]
    status, body = await post_json(
        f"{session.base_url}/messages", GOOD | {"messages": messages, "thinking": {"type": "adaptive"}}
    )
    assert status == 200 and body["type"] == "message", body
    prompt = tiny_chat.tokenizer.decode(scripted_proxy.scripted.requests[0].prompt_token_ids)
    assert "<|im_start|>system\nagents: none<|im_end|>" in prompt
    # Its probe of the base URL before the first call (HEAD ANTHROPIC_BASE_URL) finds the session up.
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for url in (session.base_url.removesuffix("/v1"), session.base_url):
            async with http.head(url) as response:
                assert response.status == 200, url
        async with http.head(session.base_url.removesuffix("/v1")[:-3] + "xyz") as response:
            assert response.status == 404  # an unknown session is not


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "5"}],
                    }
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "add"},
                    ASSISTANT_CALL,
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}],
                    },
                ]
            },
            "messages[2].content[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "thinking", "thinking": "made up", "signature": "x"}],
                    },
                    {"role": "user", "content": "go on"},
                ]
            },
            "messages[1].content[0].signature",
        ),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
        ({"top_k": -3}, "top_k"),
    ],
)
async def test_bad_input_is_an_anthropic_400_naming_the_field_and_the_session_stays_usable(
    scripted_proxy, change, where
):
    session = await scripted_proxy.open_session()
    url = f"{session.base_url}/messages"
    status, body = await post_json(url, GOOD | change)
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith(where), (
        body
    )
    assert scripted_proxy.scripted.requests == []
    status, body = await post_json(url, GOOD)
    assert status == 200 and body["content"] == [{"type": "text", "text": "reply 0"}], body


async def test_errors_keep_the_anthropic_shape_for_the_sdk(scripted_proxy):
    session = await scripted_proxy.open_session()
    url = f"{session.base_url}/messages"
    for body, status, kind in [
        (b"{not json", 400, "invalid_request_error"),
        (GOOD | {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "request_too_large"),
        (GOOD | {"model": "claude-opus-4"}, 404, "not_found_error"),
    ]:
        answer = await post_json(url, body)
        assert (answer[0], answer[1]["error"]["type"]) == (status, kind), answer
    assert (await post_json(url.replace(session.token, "nobody"), GOOD))[1]["error"][
        "type"
    ] == "not_found_error"
    async with _agent(session) as agent:
        import anthropic

        with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
            await agent.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}]
            )
        assert (await agent.messages.create(**GOOD)).content[0].text == "reply 0"
    await scripted_proxy.close_session(session)
    status, body = await post_json(url, GOOD)
    assert (status, body["type"]) == (409, "error")


async def test_unknown_fields_are_counted_by_name_or_refused_when_strict(tiny_chat):
    unknown = GOOD | {
        "frobnicate": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}],
    }
    client = ScriptedClient(tiny_chat.tokenizer)
    switchless = tiny_chat.renderer_with(renderer="default")
    async with TITOProxy(client, switchless, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        status, body = await post_json(
            f"{session.base_url}/messages", unknown | {"thinking": {"type": "disabled"}}
        )
        assert status == 200, body
        assert session.trace.ignored == {
            "frobnicate": 1,
            "messages[0].content[0].x": 1,
            "chat_template_kwargs.enable_thinking": 1,  # thinking.type: the template has no switch
        }
    async with TITOProxy(
        client, switchless, tiny_chat.tokenizer, model_name=MODEL, strict_requests=True
    ) as proxy:
        session = await proxy.open_session()
        for field, where in [
            ({"frobnicate": 1}, "unsupported field 'frobnicate'"),
            ({"messages": unknown["messages"]}, "unsupported field 'messages[0].content[0].x'"),
            ({"thinking": {"type": "disabled"}}, "chat_template_kwargs.enable_thinking"),
        ]:
            status, body = await post_json(f"{session.base_url}/messages", GOOD | field)
            assert status == 400 and body["error"]["message"].startswith(where), body
            assert "strict_requests" in body["error"]["message"]
    assert len(client.requests) == 1
