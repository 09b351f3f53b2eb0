"""Routed experts over HTTP: the packed wire form, the engine server's responses and the remote client.

The server runs the tiny MoE model with routed experts on; what ``RemoteInferenceClient`` decodes must equal
what an in-process engine on the same weights returns.
"""

from __future__ import annotations

import base64
import copy
import json

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from rollflow.inference.client import collect_stream
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.remote import RemoteInferenceClient, RemoteInferenceError
from rollflow.inference.routed_experts import pack_routed_experts, unpack_routed_experts
from rollflow.messages import GenerateRequest, SamplingParams

# The server tests share one server, so they share its event loop.
module_loop = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [5, 17, 300, 42, 9, 11]


# ---------------------------------------------------------------------------- packing


@pytest.mark.parametrize(
    ("largest", "dtype"), [(0, "uint8"), (255, "uint8"), (256, "int16"), (32767, "int16"), (32768, "int32")]
)
def test_pack_picks_the_smallest_dtype_and_round_trips(largest, dtype):
    experts = np.arange(24, dtype=np.int64).reshape(4, 3, 2) % 7
    experts[-1, -1, -1] = largest
    packed = pack_routed_experts(experts)
    assert packed["dtype"] == dtype and packed["shape"] == [4, 3, 2]
    # Raw C-ordered little-endian bytes, base64.
    assert base64.b64decode(packed["data"]) == experts.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    unpacked = unpack_routed_experts(packed)
    assert unpacked.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(unpacked, experts)


def test_unpack_accepts_nested_lists_none_and_empty():
    assert unpack_routed_experts(None) is None
    np.testing.assert_array_equal(unpack_routed_experts([[[1, 2]], [[3, 0]]]), [[[1, 2]], [[3, 0]]])
    empty = unpack_routed_experts(pack_routed_experts(np.zeros((0, 2, 2), dtype=np.uint8)))
    assert empty.shape == (0, 2, 2)


@pytest.mark.parametrize(
    ("experts", "match"),
    [
        (np.zeros((3, 2)), "3-D integer array"),
        (np.zeros((3, 2, 2), dtype=bool), "3-D integer array"),
        (np.zeros((3, 2, 2), dtype=np.float32), "3-D integer array"),
        (np.full((1, 1, 1), -1), "negative expert id"),
        (np.full((1, 1, 1), 2**31), "does not fit int32"),
    ],
)
def test_pack_rejects_what_is_not_routes(experts, match):
    with pytest.raises(ValueError, match=match):
        pack_routed_experts(experts)


GOOD = pack_routed_experts(np.ones((2, 2, 2), dtype=np.int64))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({**GOOD, "dtype": "int64"}, "dtype 'int64'; expected one of uint8, int16, int32"),
        ({**GOOD, "dtype": "float32"}, "dtype 'float32'"),
        ({**GOOD, "data": "not base64!"}, "not valid base64"),
        ({**GOOD, "data": 12}, "base64 string"),
        ({**GOOD, "shape": [2, 2]}, "three non-negative integers"),
        ({**GOOD, "shape": [2, -2, 2]}, "three non-negative integers"),
        ({**GOOD, "shape": [2, True, 2]}, "three non-negative integers"),
        (
            {**GOOD, "shape": [3, 2, 2]},
            r"has 8 bytes; shape \[3, 2, 2\] of uint8 needs 3 \* 2 \* 2 \* 1 = 12",
        ),
        (
            pack_routed_experts(np.full((1, 1, 2), 300))
            | {"data": base64.b64encode(b"\xff\xff\x01\x00").decode()},
            "negative expert id",
        ),
        ({"data": GOOD["data"]}, "lacks shape, dtype"),
        ([[[1, 2]], [[3]]], "ragged"),
        ([[1, 2], [3, 4]], "3-D integer array"),
        ([[[1.5]]], "3-D integer array"),
        ([], "3-D"),
        ("AAAA", "packed object"),
    ],
)
def test_unpack_rejects_malformed_routes_clearly(value, match):
    with pytest.raises(ValueError, match=match):
        unpack_routed_experts(value)


# ---------------------------------------------------------------------------- engine server and client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_moe_model_dir):
    # By name (its renderer is known), built in the same cache as ``tiny_moe_model_dir``.
    server = EngineServer.from_model(
        "rollflow:tiny-moe", max_batch_size=4, max_model_len=256, return_routed_experts=True
    )
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(server):
    """An in-process engine on the server's weights, routed experts on."""
    engine = TorchEngine(
        copy.deepcopy(server.engine.model), max_batch_size=1, max_model_len=256, return_routed_experts=True
    )
    yield engine
    await engine.shutdown()


async def post(server, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


@module_loop
async def test_generate_and_completions_return_packed_routes(server, reference):
    expected = await reference.generate(GenerateRequest(PROMPT, GREEDY))
    rows = len(PROMPT) + len(expected.token_ids) - 1
    assert expected.routed_experts.shape == (rows, 2, 2)
    body = await post(
        server,
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}},
    )
    packed = body["choices"][0]["routed_experts"]
    assert packed["dtype"] == "uint8" and packed["shape"] == [rows, 2, 2]
    np.testing.assert_array_equal(unpack_routed_experts(packed), expected.routed_experts)
    body = await post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    np.testing.assert_array_equal(
        unpack_routed_experts(body["choices"][0]["routed_experts"]), expected.routed_experts
    )


@module_loop
async def test_chat_returns_routes_plain_and_streamed(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    plain = await post(server, "/v1/chat/completions", body | {"return_token_ids": True})
    choice = plain["choices"][0]
    routes = unpack_routed_experts(choice["routed_experts"])
    assert routes.shape == (len(plain["prompt_token_ids"]) + len(choice["token_ids"]) - 1, 2, 2)
    streamed = body | {"stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + "/v1/chat/completions", json=streamed) as response,
    ):
        text = await response.text()
    events = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
    # Only the last chunk carries them: routes are per token run, prompt included, so they do not split.
    carrying = [c for event in events for c in event["choices"] if c.get("routed_experts") is not None]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] is not None
    np.testing.assert_array_equal(unpack_routed_experts(carrying[0]["routed_experts"]), routes)


@pytest.mark.http_only(reason="RemoteInferenceClient's route decoding")
@module_loop
async def test_remote_client_decodes_routes_plain_and_streamed(server, reference):
    request = GenerateRequest(PROMPT, GREEDY)
    expected = await reference.generate(request)
    async with RemoteInferenceClient(server.url, [server.url], request_timeout_s=30) as client:
        output = await client.generate(request)
        streamed = await collect_stream(client.generate_stream(request))
    assert output.token_ids == streamed.token_ids == expected.token_ids
    np.testing.assert_array_equal(output.routed_experts, expected.routed_experts)
    np.testing.assert_array_equal(streamed.routed_experts, expected.routed_experts)


@module_loop
async def test_routes_are_off_unless_enabled(tiny_moe_model_dir):
    server = EngineServer.from_model(str(tiny_moe_model_dir), max_batch_size=1, max_model_len=64)
    await server.start()
    try:
        body = await post(
            server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        )
        assert body["choices"][0]["routed_experts"] is None
        body = await post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert "routed_experts" not in body["choices"][0]
    finally:
        await server.close()


@pytest.mark.http_only(reason="RemoteInferenceClient's route checks")
@module_loop
@pytest.mark.parametrize(
    ("routed_experts", "match"),
    [
        ({**GOOD, "dtype": "int64"}, "dtype 'int64'"),
        (
            pack_routed_experts(np.zeros((3, 2, 2), dtype=np.uint8)),
            "routed_experts for 3 tokens.*expected 7 or 8",
        ),
        ([[[0, 1]]] * 7, None),
    ],
)
async def test_remote_client_checks_the_routes_it_receives(routed_experts, match):
    """A stand-in server answers 6 prompt tokens with 2 tokens: 7 or 8 rows of routes are valid."""

    async def generate(request: web.Request) -> web.Response:
        choice = {
            "token_ids": [1, 2],
            "logprobs": {"content": [{"logprob": -1.0}] * 2},
            "finish_reason": "length",
        }
        return web.json_response({"choices": [{**choice, "routed_experts": routed_experts}]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with RemoteInferenceClient(url, [url], request_timeout_s=10) as client:
            if match is None:
                output = await client.generate(GenerateRequest(PROMPT, GREEDY))
                assert output.routed_experts.shape == (7, 1, 2)
            else:
                with pytest.raises(RemoteInferenceError, match=match) as error:
                    await client.generate(GenerateRequest(PROMPT, GREEDY))
                assert url in str(error.value)
    finally:
        await runner.cleanup()
