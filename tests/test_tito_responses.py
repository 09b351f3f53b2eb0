"""The OpenAI Responses API on a session URL, driven by the official openai SDK (``client.responses``):
real tiny-model turns recorded with exact tokens (logprobs recomputed), streamed and not, tools, reasoning
items, ``previous_response_id``, a Chat Completions turn of the same session sharing the prefix, and bad input
answered with a 4xx in the API's shape while the session stays usable."""

from __future__ import annotations

import asyncio
import json

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
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_PARAMETERS,
}


def _sent_back(response) -> list[dict]:
    """A response's output items as an agent appends them to its next input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


@pytest.mark.slow
async def test_real_turns_streamed_and_not_share_the_tree_with_chat_completions(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            history = [{"role": "user", "content": "name a fruit"}]
            first = await client.responses.create(
                model=MODEL, instructions="answer", input=history, max_output_tokens=8, extra_body={"seed": 1}
            )
            history += [*_sent_back(first), {"role": "user", "content": "another"}]
            events = []
            # Seeded: about one unseeded 8-token reply in 40 is reasoning only, with no text to stream.
            async with client.responses.stream(
                model=MODEL, instructions="answer", input=history, max_output_tokens=8, extra_body={"seed": 0}
            ) as stream:
                async for event in stream:
                    events.append(event.type)
                second = await stream.get_final_response()
            third = await client.responses.create(
                model=MODEL,
                instructions="answer",
                previous_response_id=second.id,
                input="and one more",
                max_output_tokens=8,
                extra_body={"seed": 2},
            )
            messages = [
                {"role": "system", "content": "answer"},
                {"role": "user", "content": "name a fruit"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "another"},
                {"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "and one more"},
                {"role": "assistant", "content": third.output_text},
                {"role": "user", "content": "thanks"},
            ]
            chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=3)
        trace = await proxy.close_session(session)

    turns = trace.turns
    assert [t.render.method for t in turns] == ["full", "bridge", "bridge", "bridge"]
    assert len(trace.leaves()) == 1  # one branch: the Chat Completions turn extends the Responses turns
    assert chat.choices[0].message.content == turns[3].message["content"]
    for response, turn in zip((first, second, third), turns, strict=False):
        assert response.id.startswith("resp_") and response.output_text == turn.message["content"]
        assert response.usage.input_tokens == turn.prompt_len
        assert response.usage.output_tokens == len(turn.completion_ids)
        assert response.status == ("incomplete" if turn.finish_reason == "length" else "completed")
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.completed"
    assert second.output_text and "response.output_text.delta" in events
    checked = assert_logprobs_recomputed(trace, tiny_chat.model_dir)
    assert checked == 2 * sum(len(t.completion_ids) for t in turns)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_tool_episode_with_reasoning_items_trains_exactly_the_sampled_tokens(
    inference_client, tiny_chat, stream
):
    reasoned = tiny_chat.renderer_with(enable_thinking=True)
    script = {0: "<think>\nadd them\n</think>\n\n" + tool_call_text("add", a=2, b=3)}
    policy = ScriptedPolicy(inference_client, tiny_chat.tokenizer, lambda call, _: script.get(call))
    async with TITOProxy(
        policy, reasoned, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:

            async def respond(items):
                if not stream:
                    return await client.responses.create(model=MODEL, input=items, tools=[ADD])
                async with client.responses.stream(model=MODEL, input=items, tools=[ADD]) as events:
                    async for _ in events:
                        pass
                    return await events.get_final_response()

            items = [{"role": "user", "content": "add 2 and 3"}]
            first = await respond(items)
            reasoning, call = first.output  # the reply is only a tool call: no message item
            items += [
                *_sent_back(first),
                {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
            ]
            second = await respond(items)
        trace = await proxy.close_session(session)

    assert reasoning.type == "reasoning" and reasoning.content[0].text == "add them"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "add", {"a": 2, "b": 3})
    turns = trace.turns
    assert turns[0].message["reasoning_content"] == "add them"
    assert [t.render.method for t in turns] == ["full", "bridge"]  # the items read back as the recorded turn
    assert second.output_text == turns[1].message["content"]
    assert assert_parity(trace, policy.calls) == sum(len(t.completion_ids) for t in turns)


@pytest.fixture
async def scripted_proxy(tiny_chat):
    async with scripted_tito_proxy(tiny_chat) as proxy:
        yield proxy


GOOD = {"model": MODEL, "input": "hi", "max_output_tokens": 4}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "5"}]}, "input[0].call_id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"tools": [{"type": "namespace", "name": "agents"}]}, "tools[0].name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"background": True}, "background"),
        ({"temperature": 5}, "temperature"),
        ({"input": 5}, "input"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field_and_the_session_stays_usable(
    scripted_proxy, change, param
):
    session = await scripted_proxy.open_session()
    url = f"{session.base_url}/responses"
    status, body = await post_json(url, GOOD | change)
    assert (status, body["error"]["param"]) == (400, param), body
    assert scripted_proxy.scripted.requests == []
    status, body = await post_json(url, GOOD)
    assert status == 200 and body["output"][0]["content"][0]["text"] == "reply 0", body


async def test_malformed_oversized_and_unknown_session(scripted_proxy):
    session = await scripted_proxy.open_session()
    url = f"{session.base_url}/responses"
    status, body = await post_json(url, b"{not json")
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = await post_json(url, GOOD | {"input": "x" * 5000})
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    status, body = await post_json(url.replace(session.token, "nobody"), GOOD)
    assert (status, body["error"]["code"]) == (404, "session_not_found")
    status, body = await post_json(url, GOOD | {"model": "gpt-5"})
    assert (status, body["error"]["param"]) == (404, "model")
    assert (await post_json(url, GOOD))[0] == 200


async def test_unknown_fields_are_counted_by_name_or_refused_when_strict(tiny_chat):
    unknown = GOOD | {
        "frobnicate": 1,
        "input": [{"role": "user", "content": "hi", "colour": "red"}],
        "truncation": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "web_search", "external_web_access": False}],
    }
    client = ScriptedClient(tiny_chat.tokenizer)
    switchless = tiny_chat.renderer_with(renderer="default")
    async with TITOProxy(client, switchless, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        status, body = await post_json(f"{session.base_url}/responses", unknown)
        assert status == 200, body
        assert session.trace.ignored == {
            "frobnicate": 1,
            "input[0].colour": 1,
            "truncation": 1,
            "chat_template_kwargs.enable_thinking": 1,
            "tools[0].external_web_access": 1,
            "tools[0].type": 1,  # a hosted tool: left out
        }
    async with TITOProxy(
        client, switchless, tiny_chat.tokenizer, model_name=MODEL, strict_requests=True
    ) as proxy:
        session = await proxy.open_session()
        for field, param in [
            ({"frobnicate": 1}, "frobnicate"),
            ({"input": unknown["input"]}, "input[0].colour"),
            ({"truncation": "auto"}, "truncation"),
            ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
        ]:
            status, body = await post_json(f"{session.base_url}/responses", GOOD | field)
            assert (status, body["error"]["param"]) == (400, param), body
            assert "strict_requests" in body["error"]["message"]
    assert len(client.requests) == 1


async def test_namespace_tools_are_served_as_their_function_tools(tiny_chat):
    """Codex CLI groups its sub-agent tools in a ``namespace`` tool: the model sees each of them."""
    client = ScriptedClient(tiny_chat.tokenizer)
    tool = {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [tool]}
        status, body = await post_json(f"{session.base_url}/responses", GOOD | {"tools": [namespace]})
        assert status == 200, body
    prompt = tiny_chat.tokenizer.decode(client.requests[0].prompt_token_ids)
    assert '"name": "close_agent"' in prompt and "multi_agent_v1" not in prompt


async def test_an_error_after_the_stream_began_is_an_error_event(tiny_chat):
    class Failing(ScriptedClient):
        async def generate_stream(self, request):
            from rollflow.errors import EngineError
            from rollflow.messages import GenerateChunk

            yield GenerateChunk(request.request_id, [11], [-0.5], [0], None, len(request.prompt_token_ids))
            await asyncio.sleep(0.2)  # the stream has begun
            raise EngineError("the engine fell over", code="invalid_request")

    async with TITOProxy(
        Failing(tiny_chat.tokenizer), tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "error"
