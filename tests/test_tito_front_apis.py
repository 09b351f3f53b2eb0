"""The TITO proxy's hot path (``rollflow.http.front``) for the Responses and Anthropic Messages APIs, over
real loopback sockets: non-streamed turns of open sessions are answered by ``HttpFront`` (the official
``openai`` and ``anthropic`` SDKs' calls included), with the same status and body, in each API's own error
shape, as aiohttp's route gives for the same input.

The engine is a ``ScriptedClient`` (chosen replies): the front's answer and aiohttp's to one input must be
comparable, which sampled replies are not. The same paths over the real tiny model are covered by
``test_tito_responses.py`` and ``test_tito_anthropic.py``, whose non-streamed SDK calls take the front too.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from .helpers.raw_http import exchange, raw_post
from .helpers.tito import ADD_PARAMETERS, MODEL, scripted_tito_proxy, tool_call_text

pytestmark = pytest.mark.asyncio

ENDPOINTS = {"responses": "responses", "messages": "messages"}


@pytest.fixture
async def proxy(tiny_chat):
    async with scripted_tito_proxy(tiny_chat, max_model_len=64, max_body_bytes=64 * 1024) as p:
        yield p


def on_front_only(proxy) -> bool:
    """Every open connection is still the front's (none was handed to aiohttp)."""
    return len(proxy.fronts) >= 1 and proxy.open_connections() == len(proxy.fronts)


async def test_openai_sdk_responses_are_answered_by_the_front(proxy):
    script = {0: tool_call_text("add", a=2, b=3)}
    proxy.scripted.reply = lambda call, request: script.get(call, "five")
    session = await proxy.open_session()
    tool = {"type": "function", "name": "add", "parameters": ADD_PARAMETERS}
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
        history: list = [{"role": "user", "content": "add 2 and 3"}]
        first = await client.responses.create(
            model=MODEL, instructions="use tools", input=history, tools=[tool]
        )
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
        history += [item.model_dump(exclude_none=True) for item in first.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
        second = await client.responses.create(
            model=MODEL, instructions="use tools", input=history, tools=[tool]
        )
        assert second.output_text == "five" and on_front_only(proxy)
        # An error the front answers (the model is checked once the request decoded): the SDK's error
        # with OpenAI's body, and the connection stays on the front.
        with pytest.raises(openai.NotFoundError) as refused:
            await client.responses.create(model="other", input="hi")
        assert refused.value.body["code"] == "model_not_found" and on_front_only(proxy)
        third = await client.responses.create(
            model=MODEL,
            instructions="use tools",
            previous_response_id=second.id,
            input="thanks",
            tools=[tool],
        )
        assert third.status == "completed" and on_front_only(proxy)
    trace = await proxy.close_session(session)
    assert [turn.render.method for turn in trace.turns] == ["full", "bridge", "bridge"]
    assert len(trace.leaves()) == 1


async def test_anthropic_sdk_messages_are_answered_by_the_front(proxy):
    script = {0: tool_call_text("add", a=2, b=3)}
    proxy.scripted.reply = lambda call, request: script.get(call, "five")
    session = await proxy.open_session()
    tool = {"name": "add", "description": "Add two integers.", "input_schema": ADD_PARAMETERS}
    base_url = session.base_url.removesuffix("/v1")
    import anthropic  # here, not at the top: ~2 s in every collecting worker

    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages: list = [{"role": "user", "content": "add 2 and 3"}]
        first = await client.messages.create(
            model=MODEL, system="use tools", messages=messages, tools=[tool], max_tokens=32
        )
        assert first.stop_reason == "tool_use"
        (use,) = [block for block in first.content if block.type == "tool_use"]
        assert use.name == "add" and use.input == {"a": 2, "b": 3}
        messages += [
            {
                "role": "assistant",
                "content": [block.model_dump(exclude_none=True) for block in first.content],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
        ]
        second = await client.messages.create(
            model=MODEL, system="use tools", messages=messages, tools=[tool], max_tokens=32
        )
        assert [block.text for block in second.content] == ["five"] and on_front_only(proxy)
        assert second.usage.output_tokens == len(proxy.scripted.outputs[1].token_ids)
        with pytest.raises(anthropic.NotFoundError) as refused:
            await client.messages.create(model="other", messages=messages, max_tokens=32)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "not_found_error" and on_front_only(proxy)
    trace = await proxy.close_session(session)
    assert [turn.render.method for turn in trace.turns] == ["full", "bridge"]


def good_body(api: str, text: str = "hi", **fields) -> dict:
    if api == "responses":
        return {"model": MODEL, "input": text, **fields}
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": text}], **fields}


def bad_body(api: str, case: str) -> dict | bytes:
    """The body of one bad (or, for ``ok`` and ``stream``, good) input of ``api``."""
    if case == "bad_json":
        return b'{"model": '
    if case == "wrong_type":
        return good_body(api, temperature="hot")
    if case == "unknown_model":
        return good_body(api, model="other")
    if case == "too_long":  # fits the body limit, not the context
        return good_body(api, "word " * 2000)
    if case == "oversize":
        return good_body(api, "word " * 20_000)
    if case == "stream":
        return good_body(api, stream=True)
    if case == "orphan_result":
        if api == "responses":
            return good_body(api, input=[{"type": "function_call_output", "call_id": "c1", "output": "5"}])
        result = {"type": "tool_result", "tool_use_id": "c1", "content": "5"}
        return good_body(api, messages=[{"role": "user", "content": [result]}])
    if case == "missing_field":
        body = good_body(api)
        del body["input" if api == "responses" else "max_tokens"]
        return body
    return good_body(api)


def without_ids(answer: dict) -> dict:
    """A successful answer without what differs per turn (ids, times)."""
    for key in ("id", "created_at"):
        answer.pop(key, None)
    for item in answer.get("output", ()):
        item.pop("id")
    return answer


EXPECTED = {
    "ok": 200,
    "bad_json": 400,
    "wrong_type": 400,
    "unknown_model": 404,
    "too_long": 400,
    "oversize": 413,
    "orphan_result": 400,
    "missing_field": 400,
    "key_reused": 422,
    "unknown_session": 404,
}


@pytest.mark.parametrize("api", list(ENDPOINTS))
@pytest.mark.parametrize("case", [*EXPECTED, "stream"])
async def test_front_answers_as_aiohttp_does(proxy, api, case):
    """Each input once through the front (a Content-Length body) and once through aiohttp (a chunked one):
    the same status and body, but for ids and times; errors in the API's own shape; the session stays
    usable after them."""
    proxy.scripted.reply = lambda call, request: "the same reply"
    session = await proxy.open_session()
    token = "nope" if case == "unknown_session" else session.token
    path = f"/sessions/{token}/v1/{ENDPOINTS[api]}"
    body = bad_body(api, case)
    extra = b""
    if case == "key_reused":
        extra = b"Idempotency-Key: k1\r\n"
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        try:
            first = await exchange(reader, writer, raw_post(path, good_body(api, "first"), extra=extra))
        finally:
            writer.close()
        assert first[0] == 200

    answers = []
    for chunked in (False, True):
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        try:
            answers.append(await exchange(reader, writer, raw_post(path, body, extra=extra, chunked=chunked)))
            # The session stays usable, on the same connection.
            after = await exchange(
                reader, writer, raw_post(f"/sessions/{session.token}/v1/{api}", good_body(api))
            )
        finally:
            writer.close()
        assert after[0] == 200, after
    (front_status, front_headers, front_body), (status, headers, reference) = answers
    assert front_status == status
    if case == "stream":
        assert front_headers["content-type"] == headers["content-type"] == "text/event-stream"
        return
    assert status == EXPECTED[case], (case, reference)
    front_json, reference_json = json.loads(front_body), json.loads(reference)
    if status == 200:
        assert without_ids(front_json) == without_ids(reference_json)
        return
    for answer in (front_json, reference_json):  # the API's own error shape, both ways
        if api == "messages":
            kinds = {404: "not_found_error", 413: "request_too_large"}
            assert answer["type"] == "error"
            assert answer["error"]["type"] == kinds.get(status, "invalid_request_error"), answer
        else:
            assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    if case == "oversize":
        # aiohttp's own limit answers a chunked body (it has no length to check first): its message differs.
        for answer in (front_json, reference_json):
            answer["error"].pop("message"), answer["error"].pop("code", None)
    assert front_json == reference_json
