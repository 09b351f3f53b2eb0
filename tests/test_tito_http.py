"""The proxy's HTTP contract: every bad input is a JSON 4xx naming the problem; never a 5xx."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollflow.tito import TITOProxy
from tests.helpers.posts import post_json
from tests.helpers.tito import MODEL, ScriptedClient, scripted_tito_proxy

pytestmark = pytest.mark.asyncio

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
async def proxy(tiny_chat):
    async with scripted_tito_proxy(tiny_chat) as proxy:
        yield proxy


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": "two"}, "n"),
        ({"n": 2, "stream": True}, "n"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop": 5}, "stop"),
        ({"include_stop_str_in_output": 3}, "include_stop_str_in_output"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"min_p": 0.1}, "min_p"),  # sampling is not enforced here, and no engine implements min_p
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio", "text": "x"}]}]},
            "messages[0].content[0].type",
        ),
        ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools[0].type"),
    ],
)
async def test_unsupported_fields_are_400_naming_the_field(proxy, change, param):
    session = await proxy.open_session()
    status, body = await post_json(f"{session.base_url}/chat/completions", GOOD | change)
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert param.split(".")[-1].split("[")[0] in body["error"]["message"]
    assert proxy.scripted.requests == []


UNKNOWN = {
    "frobnicate": True,  # unknown top-level field
    "messages": [{"role": "user", "content": "hi", "colour": 1}],  # unknown message field
    "tool_choice": "required",  # known, but cannot be enforced
    "chat_template_kwargs": {"add_vision_id": True},  # a template switch the proxy does not apply
}


async def test_unknown_fields_are_ignored_and_counted_or_refused_when_strict(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        status, body = await post_json(f"{session.base_url}/chat/completions", GOOD | UNKNOWN)
        assert status == 200, body
        stats = session.trace.stats
        assert (stats.unknown_fields, stats.ignored_values) == (2, 2)
        assert set(session.trace.ignored) == {
            "frobnicate",
            "messages[0].colour",
            "tool_choice",
            "chat_template_kwargs.add_vision_id",
        }
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, strict_requests=True
    ) as proxy:
        session = await proxy.open_session()
        url = f"{session.base_url}/chat/completions"
        for field, param in [
            ({"frobnicate": True}, "frobnicate"),
            ({"messages": UNKNOWN["messages"]}, "messages[0].colour"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"chat_template_kwargs": {"add_vision_id": True}}, "chat_template_kwargs.add_vision_id"),
        ]:
            status, body = await post_json(url, GOOD | field)
            assert (status, body["error"]["param"]) == (400, param), body
            assert "strict_requests" in body["error"]["message"]
    assert len(client.requests) == 1


async def test_malformed_bodies_and_lengths(proxy):
    session = await proxy.open_session()
    url = f"{session.base_url}/chat/completions"
    status, body = await post_json(url, b"{not json")
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = await post_json(url, b"")
    assert status == 400
    status, body = await post_json(url, GOOD | {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert (status, body["error"]["code"]) == (413, "request_too_large")

    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async with aiohttp.ClientSession() as http, http.post(url, data=chunks()) as response:
        assert response.status == 413  # no Content-Length: the limit applies while reading
        assert "error" in await response.json(content_type=None)


async def test_malformed_content_length_is_400(proxy):
    session = await proxy.open_session()
    path = session.base_url.split(str(proxy.port), 1)[1] + "/chat/completions"
    for length in (b"abc", b"-5", b"1, 2"):
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        writer.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}"
        )
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        assert status_line.split()[1] == b"400", (length, status_line)


async def test_unknown_model_session_and_closed_session(proxy):
    session = await proxy.open_session()
    status, body = await post_json(f"{session.base_url}/chat/completions", GOOD | {"model": "gpt-4o"})
    assert (status, body["error"]["param"], body["error"]["code"]) == (404, "model", "model_not_found")

    bogus = session.base_url.replace(session.token, "not-a-session")
    status, body = await post_json(f"{bogus}/chat/completions", GOOD)
    assert (status, body["error"]["code"]) == (404, "session_not_found")
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.base_url}/nowhere") as response:
        assert response.status == 404 and "error" in await response.json()

    status, _ = await post_json(f"{session.base_url}/chat/completions", GOOD)
    assert status == 200
    await proxy.close_session(session)
    status, body = await post_json(f"{session.base_url}/chat/completions", GOOD)
    assert (status, body["error"]["code"]) == (409, "session_closed")


async def test_models_endpoint(proxy):
    session = await proxy.open_session()
    async with aiohttp.ClientSession() as http, http.get(f"{session.base_url}/models") as response:
        assert response.status == 200
        assert [m["id"] for m in (await response.json())["data"]] == [MODEL]


async def test_admin_endpoints_need_the_bearer_token(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, admin_token="sesame"
    ) as p:
        auth = {"Authorization": "Bearer sesame"}
        status, body = await post_json(f"{p.base_url}/sessions", {})
        assert (status, body["error"]["type"]) == (401, "AuthenticationError")
        status, body = await post_json(f"{p.base_url}/sessions", {"session_id": "agent-1"}, auth)
        assert status == 200 and body["session_id"] == "agent-1"
        base_url = body["base_url"]
        assert (await post_json(f"{base_url}/chat/completions", GOOD))[0] == 200

        async with aiohttp.ClientSession(headers=auth) as http:
            async with http.get(f"{p.base_url}/sessions/agent-1/trace") as response:
                trace = await response.json()
            assert trace["stats"]["turns"] == 1 and trace["turns"][0]["render"]["method"] == "full"
            async with http.get(f"{p.base_url}/sessions/nobody/trace") as response:
                assert response.status == 404

        status, body = await post_json(f"{p.base_url}/sessions/agent-1/close", {"reward": 1.0}, auth)
        assert (status, body["error"]["code"]) == (400, "invalid_request")
        assert "max_seq_len" in body["error"]["message"]
        status, body = await post_json(
            f"{p.base_url}/sessions/agent-1/close", {"reward": 1.0, "mode": "x", "max_seq_len": 9}, auth
        )
        assert (status, body["error"]["param"]) == (400, "mode")
        close = {"reward": 0.5, "mode": "per_branch", "max_seq_len": 256}
        status, body = await post_json(f"{p.base_url}/sessions/agent-1/close", close, auth)
        assert status == 200, body
        (sample,) = body["samples"]
        assert sample["reward"] == 0.5 and sum(sample["loss_mask"]) == len(client.outputs[0].token_ids)
        assert body["metrics"]["num_branches"] == 1.0
        assert (await post_json(f"{p.base_url}/sessions/agent-1/close", close, auth))[0] == 409
        assert (await post_json(f"{base_url}/chat/completions", GOOD))[0] == 409


async def test_start_failure_releases_everything(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as first:
        tasks_before = len(asyncio.all_tasks())
        second = TITOProxy(client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, port=first.port)
        with pytest.raises(OSError):
            await second.start()
        assert len(asyncio.all_tasks()) == tasks_before


async def test_enable_thinking_on_a_renderer_without_the_switch_is_ignored_and_counted(tiny_chat):
    """Agent configs send ``enable_thinking`` to every Qwen model; a template without the switch ignores it (as
    vLLM's does), and the proxy counts it, or refuses it when strict."""
    switchless = tiny_chat.renderer_with(renderer="default")
    client = ScriptedClient(tiny_chat.tokenizer)
    body = GOOD | {"chat_template_kwargs": {"enable_thinking": False}}
    async with TITOProxy(client, switchless, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        status, reply = await post_json(f"{session.base_url}/chat/completions", body)
        assert status == 200, reply
        assert session.trace.ignored == {"chat_template_kwargs.enable_thinking": 1}
        assert session.trace.turns[0].options == {}  # nothing of it was applied
    async with TITOProxy(
        client, switchless, tiny_chat.tokenizer, model_name=MODEL, strict_requests=True
    ) as proxy:
        session = await proxy.open_session()
        status, reply = await post_json(f"{session.base_url}/chat/completions", body)
        assert (status, reply["error"]["param"]) == (400, "chat_template_kwargs.enable_thinking"), reply
        assert "strict_requests" in reply["error"]["message"]
    assert len(client.requests) == 1
