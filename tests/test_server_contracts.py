"""Contract gaps of the HTTP servers, each on a real loopback server: concurrent closes of a TITO session,
deeply nested JSON, out-of-range ports, logprob bytes of partial-character tokens, reused idempotency keys,
policy versions that go backwards, model paths blamed on the port, and the API key over the dangerous
control endpoints."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from rollflow.inference.token_bytes import token_bytes
from rollflow.tito import TITOProxy
from tests.helpers.posts import post_json
from tests.helpers.tito import MODEL, ScriptedClient
from tests.helpers.waits import wait_until

KEY = "contract-key"
DEEP = b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"
# The proxy refuses unknown fields, so the nesting goes where any JSON is allowed: a tool's parameters.
DEEP_TOOLS = (
    b'{"model": "'
    + MODEL.encode()
    + b'", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
    b'"function", "function": {"name": "f", "parameters": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}}]}"
)


class FakeReceiver:
    """Receives nothing: each update loads no tensors, only sets the version."""

    def __init__(self, init_info: dict, worker_rank: int):
        pass

    def receive(self, update_info: dict) -> list:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
async def engine_server(tiny_chat, uncached_engine):
    from rollflow.inference.engine.server import EngineServer

    server = EngineServer(
        uncached_engine,
        tiny_chat.tokenizer,
        served_model_name="tiny",
        renderer=tiny_chat.renderer,
        receiver_factory=FakeReceiver,
        eos_token_ids=(tiny_chat.tokenizer.eos_token_id,),
    )
    await server.start()
    try:
        yield server
    finally:
        await server._runner.cleanup()  # the module's engine outlives the test


# ------------------------------------------------------------------ TITO session close


async def test_a_close_while_another_drains_returns_the_same_samples(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, delay_s=0.5)
    async with TITOProxy(
        scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, admin_token=KEY
    ) as proxy:
        session = await proxy.open_session("closing")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        in_flight = asyncio.create_task(post_json(f"{session.base_url}/chat/completions", chat))
        await wait_until(lambda: scripted.requests, "the request is sampling")
        close = {"reward": 1.0, "max_seq_len": 256}
        auth = {"Authorization": f"Bearer {KEY}"}
        url = f"{proxy.base_url}/sessions/closing/close"
        first, second = await asyncio.gather(post_json(url, close, auth), post_json(url, close, auth))
        assert (await in_flight)[0] == 200  # drained, not cut off
        assert first[0] == second[0] == 200
        assert len(first[1]["samples"]) == 1
        assert second[1]["samples"] == first[1]["samples"]
        status, body = await post_json(url, close, auth)  # once closed: 409
        assert status == 409 and body["error"]["code"] == "session_closed"


# ------------------------------------------------------------------ deeply nested JSON


async def test_deeply_nested_json_is_400_on_serve_router_and_proxy(engine_server, tiny_chat):
    from rollflow.inference.router import InferenceRouter

    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        status, body = await post_json(engine_server.url + path, DEEP)
        assert status == 400, (path, body)
        assert "nested too deeply" in body["error"]["message"]
    async with InferenceRouter([engine_server.url], health_check_interval_s=60) as router:
        for path in ("/v1/chat/completions", "/add_worker", "/finish_session"):
            status, body = await post_json(router.url + path, DEEP)
            assert status == 400, (path, body)
    async with TITOProxy(
        ScriptedClient(tiny_chat.tokenizer), tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        status, body = await post_json(f"{session.base_url}/chat/completions", DEEP_TOOLS)
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        deep_arguments = "[" * 5000 + "]" * 5000  # a JSON string field: decodes, then parsed as arguments
        messages = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep_arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ]
        status, body = await post_json(
            f"{session.base_url}/chat/completions", {"model": MODEL, "messages": messages}
        )
        assert status in (200, 400), body  # never a 500


# ------------------------------------------------------------------ command line


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "rollflow:tiny", "--port", "99999"],
        ["router", "--server", "http://127.0.0.1:1", "--port", "-1"],
        ["proxy", "unused.toml", "--port", "65536"],
    ],
    ids=["serve", "router", "proxy"],
)
def test_port_out_of_range_is_a_usage_error_naming_the_flag(argv):
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", *argv], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "--port" in result.stderr and "0-65535" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_an_unusable_model_path_is_blamed_not_the_port(command, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if command == "serve":
        argv = ["serve", "--model", "/etc", "--port", "0"]
        named = "--model /etc"
    else:
        config = tmp_path / "proxy.toml"
        config.write_text('[model]\npath = "/etc"\n')
        argv = ["proxy", str(config), "--port", "0"]
        named = "model.path"
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "config.json" in result.stderr
    assert "listen" not in result.stderr


# ------------------------------------------------------------------ logprob bytes


def test_token_bytes_of_partial_characters(tiny_chat):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = tiny_chat.tokenizer
    oracle = {char: byte for byte, char in bytes_to_unicode().items()}
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert partial  # byte-level BPE: some tokens are parts of characters
    for token_id in partial:
        entry = tokenizer.convert_ids_to_tokens(token_id)
        assert token_bytes(tokenizer, token_id, tokenizer.decode([token_id])) == [oracle[c] for c in entry]
    text = "naïve 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined = b"".join(bytes(token_bytes(tokenizer, i, tokenizer.decode([i]))) for i in ids)
    assert joined == text.encode()


async def test_proxy_logprob_bytes_are_the_tokens_own(tiny_chat):
    reply = "日本 café"
    scripted = ScriptedClient(tiny_chat.tokenizer, reply=lambda call, request: reply)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        status, body = await post_json(f"{session.base_url}/chat/completions", chat)
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert any("\ufffd" in item["token"] for item in content)  # the reply splits characters
    joined = b"".join(bytes(item["bytes"]) for item in content[:-1])  # the last token is the stop token
    assert joined == reply.encode()


async def test_serve_logprob_bytes_are_the_tokens_own(engine_server, tiny_chat):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    oracle = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = tiny_chat.tokenizer
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "return_token_ids": True,
        "max_tokens": 48,
        "ignore_eos": True,
        "seed": 3,
    }
    status, body = await post_json(engine_server.url + "/v1/chat/completions", chat)
    assert status == 200, body
    choice = body["choices"][0]
    for token_id, item in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        entry = tokenizer.convert_ids_to_tokens(token_id)
        if all(char in oracle for char in entry):
            assert item["bytes"] == [oracle[char] for char in entry], (token_id, entry)


# ------------------------------------------------------------------ Idempotency-Key


async def test_idempotency_key_reused_with_another_body_is_refused(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
        session = await proxy.open_session()
        url = f"{session.base_url}/chat/completions"
        headers = {"Idempotency-Key": "k1"}
        first = {"model": MODEL, "messages": [{"role": "user", "content": "first"}]}
        other = {"model": MODEL, "messages": [{"role": "user", "content": "other"}]}
        status, answer = await post_json(url, first, headers)
        assert status == 200
        status, body = await post_json(url, other, headers)
        assert status == 422
        assert body["error"]["param"] == "Idempotency-Key" and "k1" in body["error"]["message"]
        status, replay = await post_json(url, first, headers)  # the same body: the recorded reply
        assert status == 200 and replay["id"] == answer["id"]
        assert len(scripted.requests) == 1


# ------------------------------------------------------------------ policy versions


async def test_update_weights_refuses_an_older_policy_version(engine_server):
    url = engine_server.url

    async def update(version: int) -> tuple[int, dict]:
        assert (await post_json(url + "/start_weight_update"))[0] == 200
        status, body = await post_json(url + "/update_weights", {"update_info": {"policy_version": version}})
        finish = await post_json(url + "/finish_weight_update")
        assert finish[0] == 200, finish
        return status, body

    assert (await post_json(url + "/init_weight_transfer_engine", {"init_info": {}}))[0] == 200
    assert (await update(5))[0] == 200
    status, body = await update(3)
    assert status == 409 and body["error"]["param"] == "update_info"
    assert "older than policy version 5" in body["error"]["message"]
    assert engine_server.engine.policy_version == 5
    assert (await post_json(url + "/start_weight_update"))[0] == 200
    status, body = await post_json(url + "/finish_weight_update", {"weight_version": 4})
    assert status == 409 and body["error"]["param"] == "weight_version"
    assert (await post_json(url + "/finish_weight_update"))[0] == 200  # the round ends without a version
    # A new transfer session (a new trainer, a resumed run) may start from any version.
    assert (await post_json(url + "/init_weight_transfer_engine", {"init_info": {}}))[0] == 200
    assert (await update(0))[0] == 200
    assert engine_server.engine.policy_version == 0


# ------------------------------------------------------------------ API key over the control plane


async def test_api_key_guards_abort_update_weights_and_add_worker(tiny_chat, uncached_engine):
    from rollflow.inference.engine.server import EngineServer
    from rollflow.inference.router import InferenceRouter

    server = EngineServer(
        uncached_engine,
        tiny_chat.tokenizer,
        served_model_name="tiny",
        api_key=KEY,
        receiver_factory=FakeReceiver,
    )
    await server.start()
    try:
        async with InferenceRouter([server.url], api_key=KEY, health_check_interval_s=60) as router:
            calls = [
                (server.url + "/abort_requests", None),
                (server.url + "/update_weights", {"update_info": {"path": "/etc/passwd"}}),
                (server.url + "/init_weight_transfer_engine", {"init_info": {}}),
                (router.url + "/add_worker?url=http://127.0.0.1:9", None),
                (router.url + "/abort_requests", None),
            ]
            for url, body in calls:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    status, reply = await post_json(url, body, headers)
                    assert status == 401, (url, reply)
            assert [row["url"] for row in router.worker_table()] == [server.url]
    finally:
        await server._runner.cleanup()


def test_no_api_key_beyond_loopback_logs_a_warning(monkeypatch):
    from rollflow.http import auth

    warnings = []

    class Recorder:  # the module's logger may be cached by an earlier CLI test's structlog configuration
        def warning(self, event, **fields):
            warnings.append((event, fields))

    monkeypatch.setattr(auth, "log", Recorder())
    auth.warn_if_exposed("rollflow serve", "0.0.0.0", None)
    auth.warn_if_exposed("rollflow serve", "127.0.0.1", None)
    auth.warn_if_exposed("rollflow serve", "0.0.0.0", "key")
    assert len(warnings) == 1
    event, fields = warnings[0]
    assert "without an API key" in event and "0.0.0.0" in event and fields == {"host": "0.0.0.0"}
