"""The TITO proxy's sessions are bounded (issue 30, item 15): at most ``max_sessions`` open at once (a 429
``too_many_sessions`` beyond), and a session idle for ``session_idle_timeout_s`` is closed as timed out. Before,
20,000 open sessions cost ~5.3 KB each and never expired.

A real ``TITOProxy`` on loopback with the tiny model's renderer; its inference client is a stand-in that answers
when the test lets it. Waits are conditions with generous deadlines.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollflow.config import AgentConfig, build_config
from rollflow.errors import ConfigError, RequestError
from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest
from rollflow.orchestrator.builders import proxy_options
from rollflow.tito.proxy import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_TIMEOUT_S, TITOProxy
from rollflow.tito.testing import load_tiny_chat

from .helpers.waits import wait_until

TOKEN = "admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLOSE = {"reward": 1.0, "max_seq_len": 256}


class GatedClient:
    """An inference client whose replies ("hello" and the stop token) wait until ``release`` is set."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.release = asyncio.Event()
        self.started = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.started += 1
        await self.release.wait()
        ids = [
            *self.tokenizer.encode("hello", add_special_tokens=False),
            self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ]
        return GenerateOutput(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason=FinishReason.STOP,
            policy_versions=[0] * len(ids),
            prompt_len=len(request.prompt_token_ids),
        )


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    return load_tiny_chat(tiny_model_dir)


async def test_sessions_beyond_the_cap_are_429_until_one_closes(chat):
    proxy = TITOProxy(
        GatedClient(chat.tokenizer), chat.renderer, chat.tokenizer, model_name="tiny", admin_token=TOKEN,
        max_sessions=3,
    )  # fmt: skip
    async with proxy, aiohttp.ClientSession(headers=AUTH) as http:
        opened = []
        for _ in range(3):
            async with http.post(f"{proxy.base_url}/sessions", json={}) as response:
                assert response.status == 200
                opened.append((await response.json())["session_id"])
        async with http.post(f"{proxy.base_url}/sessions", json={}) as response:
            assert response.status == 429
            error = (await response.json())["error"]
        assert error["code"] == "too_many_sessions" and error["type"] == "RateLimitError"
        assert "3 sessions open" in error["message"] and "agent.max_sessions = 3" in error["message"]
        with pytest.raises(RequestError, match="agent.max_sessions") as caught:
            await proxy.open_session()
        assert caught.value.status == 429
        assert len(proxy.sessions) == 3
        async with http.post(f"{proxy.base_url}/sessions/{opened[0]}/close", json=CLOSE) as response:
            assert response.status == 200
        async with http.post(f"{proxy.base_url}/sessions", json={}) as response:
            assert response.status == 200


async def test_an_idle_session_expires_and_a_busy_one_does_not(chat):
    client = GatedClient(chat.tokenizer)
    proxy = TITOProxy(
        client,
        chat.renderer,
        chat.tokenizer,
        model_name="tiny",
        admin_token=TOKEN,
        session_idle_timeout_s=0.3,
    )
    async with proxy, aiohttp.ClientSession(headers=AUTH) as http:
        idle = await proxy.open_session("idle")
        busy = await proxy.open_session("busy")
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        turn = asyncio.ensure_future(http.post(f"{busy.base_url}/chat/completions", json=request))
        await wait_until(lambda: client.started == 1, "the busy session's request started")
        await wait_until(lambda: idle.closed, "the idle session expired")
        # The idle one is sealed as timed out; the busy one stays open however long its request takes.
        assert idle.trace.timed_out and "session_idle_timeout_s" in idle.trace.error
        assert not busy.closed and proxy.num_expired_sessions == 1
        async with http.get(f"{proxy.base_url}/sessions/idle/trace") as response:
            assert response.status == 409
            assert "expired" in (await response.json())["error"]["message"]
        async with http.post(f"{idle.base_url}/chat/completions", json=request) as response:
            assert response.status == 409
            error = (await response.json())["error"]
            assert error["code"] == "session_closed" and "expired" in error["message"]
        client.release.set()
        response = await turn
        assert response.status == 200, await response.text()
        response.release()
        # Idle once its request ended: it expires too, after the same timeout.
        await wait_until(lambda: busy.closed, "the busy session expired")
        assert len(busy.trace.turns) == 1 and busy.trace.timed_out
        # The run's own close of an expired session returns its sealed trace.
        assert await proxy.close_session(idle) is idle.trace


def test_the_caps_are_config_keys_with_the_proxys_defaults(tmp_path):
    agent = AgentConfig()
    assert (agent.max_sessions, agent.session_idle_timeout_s) == (
        DEFAULT_MAX_SESSIONS,
        DEFAULT_SESSION_IDLE_TIMEOUT_S,
    )
    config = build_config(
        {
            "output_dir": str(tmp_path),
            "agent": {"callable": "x:y", "max_seq_len": 64, "max_sessions": 7, "session_idle_timeout_s": 9.5},
        }
    )
    options = proxy_options(config)
    assert (options["max_sessions"], options["session_idle_timeout_s"]) == (7, 9.5)
    with pytest.raises(ConfigError, match="max_sessions"):
        build_config({"agent": {"callable": "x:y", "max_seq_len": 64, "max_sessions": 0}})
    with pytest.raises(ValueError, match="session_idle_timeout_s must be a positive number"):
        TITOProxy(object(), object(), object(), model_name="m", session_idle_timeout_s=0)
