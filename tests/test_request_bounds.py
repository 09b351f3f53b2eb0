"""The work one generation request may ask of ``rollflow serve`` (issue 30, item 3): prompts x ``n`` sequences
and their tokens are bounded by ``RequestLimits`` before any of it is done, with a 400 naming the limit and
the flag that raises it. A real ``EngineServer`` on loopback; nothing reaches the engine or the tokenizer.
"""

from __future__ import annotations

import copy

import aiohttp
import pytest
import pytest_asyncio

from rollflow.cli import _parser
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.request_limits import RequestLimits, request_work_error
from rollflow.models.loading import load_causal_lm, load_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")


class CountingTokenizer:
    """The real tokenizer, counting ``encode`` calls: a refused request must not have been tokenized."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded = 0

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return CountingTokenizer(load_tokenizer(tiny_model_dir)), load_causal_lm(tiny_model_dir)


async def start(parts, limits: RequestLimits | None = None) -> EngineServer:
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer

    tokenizer, model = parts
    engine = TorchEngine(copy.deepcopy(model), max_batch_size=4, max_model_len=512)
    server = EngineServer(
        engine,
        tokenizer,
        served_model_name="tiny",
        renderer=create_chat_renderer(tokenizer._tokenizer, ModelConfig()),
        request_limits=limits,
    )
    await server.start()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(parts):
    server = await start(parts)
    yield server
    await server.close()


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json()


def assert_too_large(status: int, body: dict, flag: str, param: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "request_too_large" and error["type"] == "BadRequestError"
    assert error["param"] == param
    assert flag in error["message"], error["message"]


async def test_ten_thousand_prompts_times_n_64_are_refused_before_any_work(server):
    tokenizer = server.tokenizer
    encoded, steps = tokenizer.encoded, server.engine.num_steps
    # The 40 KB body: 10,000 one-token prompts x n = 64 would queue 640,000 sequences.
    status, body = await post(
        f"{server.url}/v1/completions", {"prompt": [[5]] * 10_000, "n": 64, "max_tokens": 1}
    )
    assert_too_large(status, body, "--max-request-sequences", "prompt")
    assert "640000 sequences (10000 prompt(s) x n=64)" in body["error"]["message"]
    assert "256" in body["error"]["message"]
    # Text prompts are refused before they are tokenized.
    status, body = await post(f"{server.url}/v1/completions", {"prompt": ["hello"] * 300, "max_tokens": 1})
    assert_too_large(status, body, "--max-request-sequences", "prompt")
    assert tokenizer.encoded == encoded
    assert server.engine.num_steps == steps and server.engine.num_waiting == 0
    # n above the engine's maximum is still named as such.
    status, body = await post(f"{server.url}/v1/completions", {"prompt": [5, 6], "n": 1000})
    assert status == 400 and body["error"]["param"] == "n" and "between 1 and 64" in body["error"]["message"]
    # At the limit a request is served: 4 prompts x n = 64.
    status, body = await post(
        f"{server.url}/v1/completions", {"prompt": [[5, 6]] * 4, "n": 64, "max_tokens": 1, "temperature": 0.0}
    )
    assert status == 200 and len(body["choices"]) == 256


async def test_the_token_budget_is_checked_on_every_generation_endpoint(parts):
    server = await start(parts, RequestLimits(max_sequences=16, max_tokens=1000))
    try:
        steps = server.engine.num_steps
        # 4 prompts x n = 4 x (2 prompt tokens + 100) = 1632 tokens.
        status, body = await post(
            f"{server.url}/v1/completions", {"prompt": [[5, 6]] * 4, "n": 4, "max_tokens": 100}
        )
        assert_too_large(status, body, "--max-request-tokens", "max_tokens")
        assert "up to 1632 tokens" in body["error"]["message"] and "1000" in body["error"]["message"]
        # max_tokens null: each sequence may take the context left (512 - 2).
        status, body = await post(
            f"{server.url}/v1/completions", {"prompt": [5, 6], "n": 2, "max_tokens": None}
        )
        assert_too_large(status, body, "--max-request-tokens", "max_tokens")
        status, body = await post(
            f"{server.url}/inference/v1/generate",
            {"token_ids": [5, 6, 7], "sampling_params": {"n": 4, "max_tokens": 300}},
        )
        assert_too_large(status, body, "--max-request-tokens", "max_tokens")
        status, body = await post(
            f"{server.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 490},
        )
        assert_too_large(status, body, "--max-request-tokens", "max_tokens")
        status, body = await post(
            f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}
        )
        assert_too_large(status, body, "--max-request-sequences", "n")
        assert server.engine.num_steps == steps
        # Within both limits: served.
        status, body = await post(
            f"{server.url}/v1/completions", {"prompt": [[5, 6]] * 4, "n": 4, "max_tokens": 10}
        )
        assert status == 200 and len(body["choices"]) == 16
    finally:
        await server.close()


async def test_limits_and_flags_refuse_nonsense_and_reach_the_server():
    with pytest.raises(ValueError, match="max_sequences must be a positive integer, got 0"):
        RequestLimits(max_sequences=0)
    assert request_work_error(RequestLimits(), 4, 64) is None
    args = _parser().parse_args(
        ["serve", "--model", "m", "--max-request-sequences", "8", "--max-request-tokens", "4096"]
    )
    assert (args.max_request_sequences, args.max_request_tokens) == (8, 4096)
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--model", "m", "--max-request-sequences", "0"])
    assert _parser().parse_args(["router", "--max-request-sequences", "8"]).max_request_sequences == 8
    with pytest.raises(SystemExit):
        _parser().parse_args(["router", "--max-request-sequences", "0"])
    assert (
        _parser().parse_args(["serve", "--model", "m", "--max-request-share", "0.25"]).max_request_share
        == 0.25
    )
    for share in ("0", "1.5", "half", "nan"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["serve", "--model", "m", "--max-request-share", share])


async def test_the_router_refuses_what_asks_too_many_sequences_before_any_server_sees_it(server):
    """``rollflow router`` bounds the sequences of a generation request itself (servers such as vLLM bound
    none): over ``--max-request-sequences`` is its own 400 ``request_too_large`` on each generation path, on
    the header (hot) path and the body-session path alike; nothing reaches the server. Under the bound, and
    bodies that are not a generation request (bad JSON, another path), pass through to the server's answer."""
    from rollflow.inference.request_limits import sequences_asked
    from rollflow.inference.router import InferenceRouter

    assert sequences_asked("/v1/completions", b'{"prompt": [[1, 2], [3]], "n": 3}') == (2, 3)
    assert sequences_asked("/v1/completions", b'{"prompt": [1, 2, 3], "n": 3}') == (1, 3)
    assert sequences_asked("/v1/completions", b'{"prompt": [ "a", "b", "c"]}') == (3, 1)
    assert sequences_asked("/v1/completions", b'{"prompt": "abc", "n": 2}') == (1, 2)
    assert sequences_asked("/v1/chat/completions", b'{"messages": [], "n": 9}') == (1, 9)
    assert sequences_asked("/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"n": 7}}') == (
        1,
        7,
    )
    assert sequences_asked("/tokenize", b'{"prompt": "a"}') is None
    assert sequences_asked("/v1/completions", b"{not json") is None
    assert sequences_asked("/v1/completions", b'{"n": "many"}') is None

    async with InferenceRouter([server.url], max_request_sequences=8) as router:
        steps = server.engine.num_steps
        refused = [
            ("/v1/completions", {"prompt": [[5]] * 3, "n": 3, "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": [5, 6], "n": 9, "max_tokens": 1}, "n"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
            ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"n": 9, "max_tokens": 1}}, "n"),
        ]
        async with aiohttp.ClientSession() as http:
            for path, body, param in refused:
                for headers in ({"X-Session-ID": "s-1"}, {}):
                    async with http.post(f"{router.url}{path}", json=body, headers=headers) as response:
                        assert_too_large(
                            response.status, await response.json(), "--max-request-sequences", param
                        )
                        assert "this router" in (await response.json())["error"]["message"]
            assert server.engine.num_steps == steps, "a refused request reached the engine"
            assert router.num_refused_too_large == 2 * len(refused)
            async with http.get(f"{router.url}/metrics") as response:
                assert f"rollflow_router_refused_too_large_total {2 * len(refused)}" in await response.text()
            ok = {"prompt": [[5, 6]] * 2, "n": 4, "max_tokens": 1, "temperature": 0.0}
            async with http.post(
                f"{router.url}/v1/completions", json=ok, headers={"X-Session-ID": "s-2"}
            ) as r:
                assert r.status == 200 and len((await r.json())["choices"]) == 8
            async with http.post(
                f"{router.url}/v1/completions", data=b"{not json", headers={"X-Session-ID": "s"}
            ) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] != "request_too_large", body
