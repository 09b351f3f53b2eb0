"""The TITO proxy's hot path (``rollflow.http.front``) over real loopback sockets: non-streamed chat
completions of open sessions are answered by ``HttpFront``, through the same checks and errors as aiohttp's
path; everything else on the connection is handed to aiohttp; disconnects cancel the engine request."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollflow.http.limits import HttpLimits
from rollflow.tito import TITOProxy

from .helpers.raw_http import exchange
from .helpers.raw_http import raw_post as chat_request
from .helpers.tito import MODEL, ScriptedClient
from .helpers.waits import wait_until

pytestmark = pytest.mark.asyncio


def completions_path(session) -> str:
    return f"/sessions/{session.token}/v1/chat/completions"


def ask(text: str = "hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


async def connect(proxy: TITOProxy):
    return await asyncio.open_connection(proxy.host, proxy.port)


@pytest.fixture
async def proxy(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, max_model_len=64
    ) as p:
        p.scripted = client
        yield p


async def test_completions_on_the_front_then_other_requests_on_aiohttp(proxy):
    session = await proxy.open_session()
    reader, writer = await connect(proxy)
    try:
        status, headers, body = await exchange(reader, writer, chat_request(completions_path(session), ask()))
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body)["choices"][0]["message"]["content"] == "reply 0"
        assert len(proxy.fronts) == 1  # the front answered
        # The next turn of the same agent, on the same connection: the front again, recorded as one session.
        history = ask()["messages"] + [
            json.loads(body)["choices"][0]["message"],
            {"role": "user", "content": "go"},
        ]
        status, _, _ = await exchange(
            reader, writer, chat_request(completions_path(session), {"model": MODEL, "messages": history})
        )
        assert status == 200 and len(proxy.fronts) == 1
        # A GET is aiohttp's: the connection is handed over and keeps working.
        models = f"GET /sessions/{session.token}/v1/models HTTP/1.1\r\nHost: p\r\n\r\n".encode()
        status, _, body = await exchange(reader, writer, models)
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        assert not proxy.fronts
        status, _, _ = await exchange(reader, writer, chat_request(completions_path(session), ask("again")))
        assert status == 200
    finally:
        writer.close()
    trace = await proxy.close_session(session)
    assert trace.stats.turns == 3 and trace.turns[1].render.method == "bridge"


@pytest.mark.parametrize(
    "case",
    ["ok", "unknown_model", "too_long", "bad_json", "bad_field", "stream", "key_reused", "unknown_session"],
)
async def test_front_answers_as_aiohttp_does(proxy, case):
    """Each request once through the front and once through aiohttp (chunked body): same status and body,
    but for the completion's id and time."""
    proxy.scripted.reply = lambda call, request: "the same reply"
    session = await proxy.open_session()
    path = completions_path(session)
    body: dict | bytes = ask()
    extra = b""
    if case == "unknown_model":
        body = ask(model="other")
    elif case == "too_long":
        body = ask("word " * 20_000)
    elif case == "bad_json":
        body = b'{"model": '
    elif case == "bad_field":
        body = ask(temperature="hot")
    elif case == "stream":
        body = ask(stream=True)
    elif case == "unknown_session":
        path = "/sessions/nope/v1/chat/completions"
    elif case == "key_reused":
        extra = b"Idempotency-Key: k1\r\n"
        reader, writer = await connect(proxy)
        status, _, _ = await exchange(reader, writer, chat_request(path, ask("first"), extra=extra))
        writer.close()
        assert status == 200

    answers = []
    for chunked in (False, True):
        reader, writer = await connect(proxy)
        try:
            answers.append(
                await exchange(reader, writer, chat_request(path, body, extra=extra, chunked=chunked))
            )
        finally:
            writer.close()
    (front_status, front_headers, front_body), (status, headers, reference) = answers
    assert front_status == status
    if case == "stream":
        assert front_headers["content-type"] == headers["content-type"] == "text/event-stream"
        return
    front_json, reference_json = json.loads(front_body), json.loads(reference)
    if status == 200:
        for answer in (front_json, reference_json):
            answer.pop("id"), answer.pop("created")
    assert front_json == reference_json
    expected = {
        "ok": 200,
        "unknown_model": 404,
        "too_long": 400,
        "bad_json": 400,
        "bad_field": 400,
        "key_reused": 422,
        "unknown_session": 404,
    }
    assert status == expected[case], (case, reference_json)


async def test_closed_session_is_409_and_connection_close_is_honoured(proxy):
    session = await proxy.open_session()
    reader, writer = await connect(proxy)
    try:
        status, headers, _ = await exchange(
            reader, writer, chat_request(completions_path(session), ask(), extra=b"Connection: close\r\n")
        )
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 60) == b""  # the front closed the connection
    finally:
        writer.close()
    await proxy.close_session(session)
    reader, writer = await connect(proxy)
    try:
        status, _, body = await exchange(reader, writer, chat_request(completions_path(session), ask()))
        assert status == 409 and json.loads(body)["error"]["code"] == "session_closed"
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order(proxy):
    session = await proxy.open_session()
    reader, writer = await connect(proxy)
    try:
        raw = chat_request(completions_path(session), ask("one")) + chat_request(
            completions_path(session), ask("two")
        )
        first = await exchange(reader, writer, raw)
        second = await exchange(reader, writer, b"")
    finally:
        writer.close()
    assert [first[0], second[0]] == [200, 200]
    contents = [json.loads(answer[2])["choices"][0]["message"]["content"] for answer in (first, second)]
    assert contents == ["reply 0", "reply 1"]
    trace = await proxy.close_session(session)
    assert trace.stats.turns == 2
    prompts = [
        proxy.renderer.tokenizer.decode(request.prompt_token_ids) for request in proxy.scripted.requests
    ]
    assert "one" in prompts[0] and "two" in prompts[1]


async def test_a_caller_that_leaves_cancels_its_engine_request(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer, delay_s=30)
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        _, writer = await connect(proxy)
        writer.write(chat_request(completions_path(session), ask()))
        await writer.drain()
        await wait_until(lambda: client.requests, "the request reaches the engine")
        assert len(proxy.fronts) == 1
        writer.close()
        await wait_until(lambda: client.cancelled, "the caller's leaving cancels its engine request")
        assert client.cancelled == 1
        trace = await proxy.close_session(session)
        assert trace.stats.turns == 0


async def test_a_body_that_stops_arriving_gets_408(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    limits = HttpLimits(body_timeout_s=0.3)
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, http_limits=limits
    ) as proxy:
        session = await proxy.open_session()
        reader, writer = await connect(proxy)
        try:
            raw = chat_request(completions_path(session), ask())
            status, _, body = await exchange(reader, writer, raw[:-5])
        finally:
            writer.close()
        assert status == 408 and "body_timeout_s" in json.loads(body)["error"]["message"]
        assert not client.requests
