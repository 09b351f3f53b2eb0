"""Engine server (``rollflow serve``): vLLM 0.33 data plane and control plane over a real loopback server.

One server on the tiny model serves the module (its state is restored by each test); tests that need another
configuration start their own. The weight lifecycle uses a fake receiver injected through the constructor.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
import pytest_asyncio
import torch

from rollflow.errors import error_code
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

from .helpers.waits import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_BODY_BYTES = 256 * 1024
LONG = {"max_tokens": 1500, "ignore_eos": True}


class FakeReceiver:
    """Stands in for ``rollflow.weights``' receiver: ``update_info["tensors"]`` names tensors of a dict."""

    def __init__(self, init_info: dict, worker_rank: int, store: dict):
        if init_info.get("fail"):
            raise ValueError("fake receiver refuses init_info with fail=true")
        self.store = store
        self.worker_rank = worker_rank
        self.closed = False

    def receive(self, update_info: dict) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.store[key]) for name, key in update_info["tensors"].items()]

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def model_parts():
    model_dir = resolve_model_path("rollflow:tiny")
    return load_tokenizer(model_dir), load_causal_lm(model_dir)


def make_server(model_parts, receivers: list | None = None, **kwargs) -> EngineServer:
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer

    tokenizer, model = model_parts
    store = {"zeros_norm": torch.zeros(model.config.hidden_size), "wrong": torch.zeros(3)}

    def factory(init_info: dict, worker_rank: int) -> FakeReceiver:
        receiver = FakeReceiver(init_info, worker_rank, store)
        if receivers is not None:
            receivers.append(receiver)
        return receiver

    engine = TorchEngine(copy.deepcopy(model), max_batch_size=4, max_model_len=2048)
    return EngineServer(
        engine,
        tokenizer,
        served_model_name="tiny",
        renderer=create_chat_renderer(tokenizer, ModelConfig()),
        receiver_factory=factory,
        eos_token_ids=(tokenizer.eos_token_id,),
        max_body_bytes=MAX_BODY_BYTES,
        **kwargs,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_parts):
    server = make_server(model_parts, receivers=[])
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def post(http, server, path: str, body=None, **kwargs) -> tuple[int, dict]:
    async with http.post(server.url + path, json=body, **kwargs) as response:
        text = await response.text()
        return response.status, (json.loads(text) if text else {})


async def get(http, server, path: str) -> tuple[int, dict]:
    async with http.get(server.url + path) as response:
        return response.status, await response.json()


def assert_error(status: int, body: dict, expected_status: int, error_type: str | None = None) -> None:
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == error_code(expected_status) and body["error"]["message"]
    if error_type is not None:
        assert body["error"]["type"] == error_type


# ---------------------------------------------------------------------------- data plane


async def test_generate_tokens_mode_matches_hf_logprobs(server, http, model_parts):
    prompt = [5, 17, 300, 42, 9]
    body = {
        "token_ids": prompt,
        "request_id": "r-1",
        "return_token_ids": True,
        "sampling_params": {
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 0,
            "ignore_eos": True,
        },
    }
    status, out = await post(http, server, "/inference/v1/generate", body)
    assert status == 200, out
    assert out["request_id"] == "r-1" and out["output_mode"] == "tokens" and out["prompt_token_ids"] == prompt
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    tokens = choice["token_ids"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == tokens
    assert len(tokens) == 12 and choice["policy_versions"] == [0] * 12
    with torch.no_grad():
        logits = model_parts[1](torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(logprobs, expected.tolist(), strict=True)) < 1e-4
    # Same seed, same tokens; n=2 gives two (differently seeded) samples.
    assert (await post(http, server, "/inference/v1/generate", body))[1]["choices"][0]["token_ids"] == tokens
    body["sampling_params"]["n"] = 2
    status, out = await post(http, server, "/inference/v1/generate", body)
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 24


async def test_stop_token_and_default_max_tokens(server, http):
    greedy_body = {"token_ids": [5, 6], "sampling_params": {"temperature": 0.0, "max_tokens": 5}}
    _, out = await post(http, server, "/inference/v1/generate", greedy_body)
    greedy = out["choices"][0]["token_ids"]
    body = {"token_ids": [5, 6], "sampling_params": {"temperature": 0.0, "stop_token_ids": [greedy[0]]}}
    _status, out = await post(http, server, "/inference/v1/generate", body)
    choice = out["choices"][0]
    assert choice["token_ids"] == [greedy[0]] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == greedy[0] and choice["logprobs"] is None


async def test_completions_chat_tokenize_models_health_metrics(server, http):
    status, out = await post(http, server, "/v1/completions", {
        "model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0, "logprobs": 0,
        "return_token_ids": True, "ignore_eos": True})  # fmt: skip
    assert status == 200, out
    assert out["object"] == "text_completion" and len(out["choices"]) == 2
    first = out["choices"][0]
    assert first["prompt_token_ids"] == [5, 6, 7] and len(first["token_ids"]) == 4
    assert len(first["logprobs"]["token_logprobs"]) == 4 and first["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}

    status, out = await post(http, server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "logprobs": True,
        "return_token_ids": True})  # fmt: skip
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) <= 6
    status, tokenized = await post(
        http, server, "/tokenize", {"messages": [{"role": "user", "content": "Say hi"}]}
    )
    assert tokenized["tokens"] == out["prompt_token_ids"] and tokenized["count"] == len(
        out["prompt_token_ids"]
    )

    status, tokenized = await post(
        http, server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}
    )
    assert status == 200 and len(tokenized["token_strs"]) == tokenized["count"] > 0
    status, detok = await post(http, server, "/detokenize", {"tokens": tokenized["tokens"]})
    assert detok == {"prompt": "hello world"}

    status, models = await get(http, server, "/v1/models")
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
    async with http.get(server.url + "/health") as response:
        assert response.status == 200
    async with http.get(server.url + "/metrics") as response:
        text = await response.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
                 "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):  # fmt: skip
        assert f"\n{name}{{" in text


async def test_prefix_cache_hits_and_reset(server, http):
    engine = server.engine
    body = {"token_ids": list(range(100, 140)), "sampling_params": {"max_tokens": 3, "temperature": 0}}
    await post(http, server, "/inference/v1/generate", body)
    hits = engine.prefix_cache_hit_tokens
    await post(http, server, "/inference/v1/generate", body)
    assert engine.prefix_cache_hit_tokens == hits + 39
    assert (await post(http, server, "/reset_prefix_cache?reset_running_requests=false"))[1] == {
        "success": True
    }
    await post(http, server, "/inference/v1/generate", body)
    assert engine.prefix_cache_hit_tokens == hits + 39


# ---------------------------------------------------------------------------- control plane


async def start_long(http, server, request_id: str) -> asyncio.Task:
    body = {"token_ids": [5, 6, 7], "request_id": request_id, "sampling_params": LONG}
    task = asyncio.create_task(post(http, server, "/inference/v1/generate", body))
    await wait_until(lambda: server.engine.num_running >= 1, f"{request_id} is running")
    return task


async def test_pause_abort_returns_partials_and_refuses_new_requests(server, http):
    running = await start_long(http, server, "long-1")
    assert (await post(http, server, "/pause?mode=abort"))[1] == {"status": "paused"}
    status, out = await running
    choice = out["choices"][0]
    assert status == 200 and choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 1500
    assert (await get(http, server, "/is_paused"))[1] == {"is_paused": True}
    status, out = await post(http, server, "/inference/v1/generate", {"token_ids": [5]})
    assert_error(status, out, 503, "ServiceUnavailableError")
    assert (await post(http, server, "/resume"))[1] == {"status": "resumed"}
    assert (await get(http, server, "/is_paused"))[1] == {"is_paused": False}
    status, out = await post(http, server, "/inference/v1/generate", {"token_ids": [5], "sampling_params": {
        "max_tokens": 2}})  # fmt: skip
    assert status == 200 and len(out["choices"][0]["token_ids"]) <= 2


async def test_pause_keep_queues_and_wait_drains(server, http):
    running = await start_long(http, server, "long-2")
    await post(http, server, "/pause?mode=keep")
    queued = asyncio.create_task(post(http, server, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {
        "max_tokens": 2}}))  # fmt: skip
    await wait_until(lambda: server.engine.num_waiting == 1, "the request sent while paused queues")
    assert not queued.done() and not running.done()
    await post(http, server, "/resume")
    assert (await queued)[0] == 200
    _status, out = await running
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["token_ids"]) == 1500

    short = asyncio.create_task(post(http, server, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {
        "max_tokens": 200, "ignore_eos": True}}))  # fmt: skip
    await wait_until(lambda: server.engine.num_running >= 1, "the short request is running")
    pause = asyncio.create_task(post(http, server, "/pause?mode=wait"))
    await wait_until(lambda: server.pause_mode == "wait", "the server is pausing in wait mode")
    assert_error(*(await post(http, server, "/v1/completions", {"prompt": [5]})), 503)
    assert (await pause)[1] == {"status": "paused"}
    assert short.done() and (await short)[1]["choices"][0]["finish_reason"] == "length"
    await post(http, server, "/resume")


async def test_abort_requests_by_id(server, http):
    running = await start_long(http, server, "long-3")
    assert (await post(http, server, "/abort_requests", {"request_ids": ["other"]}))[1]["aborted"] == 0
    status, out = await post(http, server, "/inference/v1/abort_requests", {"request_ids": ["long-3"]})
    assert status == 200 and out == {}
    assert (await running)[1]["choices"][0]["finish_reason"] == "abort"
    running = await start_long(http, server, "long-4")
    assert (await post(http, server, "/abort_requests"))[1] == {"status": "aborted", "aborted": 1}
    assert (await running)[1]["choices"][0]["finish_reason"] == "abort"


async def test_sleep_and_wake_up_by_tags(server, http):
    assert (await post(http, server, "/sleep?level=1"))[1] == {"status": "sleeping", "level": 1}
    assert (await get(http, server, "/is_sleeping"))[1] == {"is_sleeping": True}
    assert_error(*(await post(http, server, "/inference/v1/generate", {"token_ids": [5]})), 503)
    async with http.get(server.url + "/metrics") as response:
        assert 'sleep_state="weights_offloaded"} 1' in await response.text()
    assert (await post(http, server, "/wake_up?tags=weights"))[1] == {
        "status": "sleeping",
        "tags": ["weights"],
    }
    _status, out = await post(http, server, "/wake_up?tags=kv_cache&tags=scheduling")
    assert out == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
    assert (await get(http, server, "/is_sleeping"))[1] == {"is_sleeping": False}
    assert (await post(http, server, "/inference/v1/generate", {"token_ids": [5], "sampling_params": {
        "max_tokens": 1}}))[0] == 200  # fmt: skip
    assert (await get(http, server, "/get_world_size"))[1] == {"world_size": 1}


async def test_weight_update_lifecycle(server, http):
    engine = server.engine
    assert_error(*(await post(http, server, "/update_weights", {"update_info": {"tensors": {}}})), 400)
    assert_error(*(await post(http, server, "/finish_weight_update")), 400)
    assert (await post(http, server, "/start_weight_update"))[0] == 200
    assert_error(*(await post(http, server, "/start_weight_update")), 400)  # double start
    # Started but not initialized.
    assert_error(*(await post(http, server, "/update_weights", {"update_info": {"tensors": {}}})), 400)
    assert_error(
        *(await post(http, server, "/init_weight_transfer_engine", {"init_info": {"fail": True}})), 400
    )
    _status, out = await post(http, server, "/init_weight_transfer_engine", {"init_info": {"rank_offset": 1}})
    assert out == {"message": "Weight transfer initialized"}
    bad = {"update_info": {"tensors": {"model.norm.weight": "wrong"}}}
    assert_error(*(await post(http, server, "/update_weights", bad)), 400)  # wrong shape: engine refuses
    # A refused update ends its round (the old weights keep serving); the trainer starts a new one.
    assert_error(*(await post(http, server, "/update_weights", bad)), 400)
    assert (await post(http, server, "/start_weight_update"))[0] == 200
    before = (await post(http, server, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 4, "temperature": 0}}))[1]["choices"][0]  # fmt: skip
    good = {"update_info": [{"tensors": {"model.norm.weight": "zeros_norm"}, "policy_version": 7}]}
    assert (await post(http, server, "/update_weights", good))[1] == {"message": "Weights updated"}
    assert engine.policy_version == 7
    assert (await post(http, server, "/finish_weight_update", {"weight_version": "8"}))[0] == 200
    assert (await get(http, server, "/weight_info"))[1]["weight_version"] == "8"
    after = (await post(http, server, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 4, "temperature": 0}}))[1]["choices"][0]  # fmt: skip
    assert after["policy_versions"] == [8] * 4 and after["logprobs"] is None
    assert after["token_ids"] != before["token_ids"] or before["policy_versions"] == [0] * 4
    # Start, update without a version: current + 1.
    await post(http, server, "/start_weight_update", {"is_checkpoint_format": True})
    await post(http, server, "/update_weights", {"update_info": {"tensors": {}}})
    await post(http, server, "/finish_weight_update")
    assert engine.policy_version == 9
    assert (await post(http, server, "/shutdown_weight_transfer_engine"))[0] == 200


async def test_api_key_guards_every_path_but_health_and_metrics(model_parts):
    server = make_server(model_parts, api_key="s3cret")
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert_error(*(await post(http, server, "/pause")), 401)
            assert_error(*(await post(http, server, "/pause", headers={"Authorization": "Bearer nope"})), 401)
            assert_error(*(await post(http, server, "/tokenize", {"prompt": "hi"})), 401)
            status, _ = await post(http, server, "/resume", headers={"Authorization": "Bearer s3cret"})
            assert status == 200
            auth = {"Authorization": "Bearer s3cret"}
            assert (await post(http, server, "/tokenize", {"prompt": "hi"}, headers=auth))[0] == 200
            for path in ("/health", "/metrics"):
                async with http.get(f"{server.url}{path}") as response:
                    assert response.status == 200, path
    finally:
        await server.close()


# ---------------------------------------------------------------------------- bad input


POST_BODY_PATHS = [
    "/inference/v1/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/abort_requests",
    "/inference/v1/abort_requests",
    "/reset_prefix_cache",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
]
ALL_POST_PATHS = [
    *POST_BODY_PATHS,
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/shutdown_weight_transfer_engine",
]

# Every field any endpoint reads, each of a wrong type.
WRONG_TYPES = (
    b'{"request_ids": 5, "update_info": 1, "reset_running_requests": "x", "is_checkpoint_format": "x", '
    b'"weight_version": [], "token_ids": {}, "prompt": 1.5, "messages": 3, "tokens": "x", "init_info": 3}'
)
BAD_BODIES = [
    (path, body)
    for path in POST_BODY_PATHS
    for body in [b'{"token_ids": [1, 2', b"[1, 2, 3]", b'"text"', b"\xff\xfe", WRONG_TYPES]
] + [
    ("/inference/v1/generate", b"{}"),  # missing token_ids
    ("/inference/v1/generate", b'{"token_ids": []}'),
    ("/inference/v1/generate", b'{"token_ids": ["a"]}'),
    ("/inference/v1/generate", b'{"token_ids": [true]}'),
    ("/inference/v1/generate", b'{"token_ids": [1.5]}'),
    ("/inference/v1/generate", b'{"token_ids": [-1]}'),
    ("/inference/v1/generate", b'{"token_ids": [99999999]}'),
    ("/inference/v1/generate", b'{"token_ids": [99999999999999999999999999]}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"max_tokens": -1}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"max_tokens": 0}}'),
    (
        "/inference/v1/generate",
        b'{"token_ids": [5], "sampling_params": {"max_tokens": 99999999999999999999}}',
    ),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"max_tokens": "5"}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"temperature": -1}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"top_p": 0}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"top_k": -5}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"n": 0}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"seed": -3}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"logprobs": 5}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"stop_token_ids": [-2]}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": {"stop": ["x"]}}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "stream": true}'),
    ("/inference/v1/generate", b'{"token_ids": [5], "sampling_params": []}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", b'{"prompt": [[5], "x"]}'),
    ("/v1/completions", b'{"prompt": [5, 99999999]}'),
    ("/v1/completions", b'{"prompt": {"a": 1}}'),
    ("/v1/completions", b'{"prompt": [5], "max_tokens": -4}'),
    ("/v1/completions", b'{"prompt": [5], "max_tokens": 100000000}'),
    ("/v1/completions", b'{"prompt": [5], "max_tokens": 2048}'),
    ("/v1/completions", b'{"prompt": [5], "logprobs": -1}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}'),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1e9}',
    ),
    ("/tokenize", b"{}"),
    ("/tokenize", b'{"prompt": "a", "messages": []}'),
    ("/detokenize", b'{"tokens": [-5]}'),
    ("/detokenize", b'{"tokens": [123456789]}'),
    ("/inference/v1/abort_requests", b"{}"),
    ("/init_weight_transfer_engine", b'{"init_info": []}'),
    ("/update_weights", b"{}"),
    ("/finish_weight_update", b'{"weight_version": "v-two"}'),
]
BAD_QUERIES = [
    "/pause?mode=later",
    "/pause?clear_cache=maybe",
    "/sleep?level=7",
    "/sleep?level=x",
    "/sleep?mode=nap",
    "/wake_up?tags=brain",
    "/reset_prefix_cache?reset_running_requests=2",
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES, ids=lambda v: v if isinstance(v, str) else None)
async def test_bad_bodies_get_4xx_json(server, http, path, body):
    async with http.post(
        server.url + path, data=body, headers={"Content-Type": "application/json"}
    ) as response:
        out = await response.json()
    assert_error(response.status, out, 400)
    assert not server.weights.update_active and server.pause_mode is None


@pytest.mark.parametrize("path", BAD_QUERIES)
async def test_bad_query_parameters_get_400(server, http, path):
    assert_error(*(await post(http, server, path)), 400)


async def test_oversized_body_unknown_path_and_wrong_method(server, http):
    big = b'{"token_ids": [' + b"1," * MAX_BODY_BYTES + b"1]}"
    for path in ALL_POST_PATHS:
        async with http.post(server.url + path, data=big) as response:
            assert_error(response.status, await response.json(), 413)
    assert_error(*(await post(http, server, "/nope")), 404)
    assert_error(*(await get(http, server, "/pause")), 405)
    assert server.pause_mode is None and not server.sleeping_tags


@pytest.mark.parametrize("content_length", [b"abc", b"-5", b"1, 2", b"99999999999999999999999999"])
async def test_invalid_content_length_gets_400_json(server, content_length):
    host, port = server.url.removeprefix("http://").split(":")
    for path in (b"/inference/v1/generate", b"/pause"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + content_length + b"\r\n\r\n{}"
        )
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 60)
        writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == b"400" and b"application/json" in head
        assert json.loads(payload)["error"]["code"] == "invalid_request"


async def test_client_disconnect_aborts_engine_request(server):
    engine = server.engine
    cancelled = engine.num_cancelled_requests
    session = aiohttp.ClientSession()
    task = asyncio.create_task(
        session.post(
            server.url + "/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": LONG}
        )
    )
    await wait_until(lambda: engine.num_running == 1, "the request is running")
    task.cancel()
    await session.close()
    await wait_until(lambda: engine.num_running == 0, "the disconnect aborts the engine request")
    assert engine.num_cancelled_requests == cancelled + 1


async def test_server_keeps_serving_after_bad_input(server, http):
    async with http.get(server.url + "/health") as response:
        assert response.status == 200
    status, out = await post(http, server, "/inference/v1/generate", {"token_ids": [5], "sampling_params": {
        "max_tokens": 2}})  # fmt: skip
    assert status == 200 and out["choices"][0]["token_ids"]


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.slow
async def test_rollflow_serve_subprocess_port_0_and_sigterm():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollflow", "serve", "--model", "rollflow:tiny", "--port", "0",
        "--max-model-len", "64", "--api-key", "k",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        ready = json.loads(line)
        assert (
            ready["event"] == "ready" and ready["url"].startswith("http://127.0.0.1:") and ready["port"] > 0
        )
        async with aiohttp.ClientSession() as http:
            async with http.post(
                ready["url"] + "/inference/v1/generate",
                json={"token_ids": [5]},
                headers={"Authorization": "Bearer k"},
            ) as response:
                assert response.status == 200
                assert len((await response.json())["choices"][0]["token_ids"]) >= 1
            async with http.get(ready["url"] + "/get_world_size") as response:
                assert response.status == 401
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
