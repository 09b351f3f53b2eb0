"""One error contract, local or remote: the same failure is the same error family (a 4xx keeps its ``code``,
an unavailable server is retryable), every listener answers it with the same JSON ``type`` and ``code``, the
weight barrier retries only what is retryable, and an agent whose prompt outgrows the context yields the same
samples and metrics in ``local`` and ``http`` mode."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import openai
import pytest
import pytest_asyncio

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InferenceUnavailableError,
    WeightTransferError,
    WeightTransferTimeoutError,
    is_retryable,
)
from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import InferenceRouter
from rollflow.messages import GenerateRequest, RolloutRequest, SamplingParams
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.rollout.agent import AgentGenerator
from rollflow.tito import TITOProxy
from rollflow.weights import StaticWeights
from tests.helpers.tito import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The servers' context (``rollflow serve``'s default for the tiny model); the local engine gets the same.
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def local_engine(tiny_model_dir):
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm

    engine = TorchEngine(load_causal_lm(tiny_model_dir), max_batch_size=8, max_model_len=MAX_MODEL_LEN)
    yield engine
    asyncio.run(engine.shutdown())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(inference_servers):
    async with InferenceRouter(inference_servers.urls, health_check_interval_s=0.5) as router:
        yield router


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ the same family, local or remote


@pytest.mark.slow
async def test_an_overlong_prompt_is_the_same_error_locally_and_over_http(
    local_engine, router, inference_servers
):
    request = GenerateRequest([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=2), request_id="long")
    local = LocalInferenceClient([local_engine])
    remote = RemoteInferenceClient(router.url, inference_servers.urls, connect_retries=0)
    try:
        errors = []
        for client in (local, remote):
            with pytest.raises(ContextLengthExceededError) as raised:
                await client.generate(request)
            errors.append(raised.value)
            with pytest.raises(ContextLengthExceededError):  # the streaming path maps it the same way
                async for _ in client.generate_stream(request):
                    pass
        for error in errors:
            assert isinstance(error, EngineError) and not is_retryable(error)
            assert (error.code, error.http_status) == (CONTEXT_LENGTH_EXCEEDED, 400)
        # Other refusals keep the generic code in both modes.
        bad = GenerateRequest([5], SamplingParams(max_tokens=2, temperature=-1.0))
        for client in (local, remote):
            with pytest.raises(EngineError) as raised:
                await client.generate(bad)
            assert raised.value.code == "invalid_request" and not is_retryable(raised.value)
    finally:
        await remote.close()


async def test_an_unreachable_server_is_retryable_and_a_dead_engine_is_not():
    url = f"http://127.0.0.1:{_closed_port()}"
    client = RemoteInferenceClient(url, connect_retries=1, request_timeout_s=5)
    try:
        with pytest.raises(InferenceUnavailableError, match="connection attempts") as raised:
            await client.generate(GenerateRequest([1, 2], SamplingParams(max_tokens=1)))
        assert is_retryable(raised.value) and raised.value.code == "service_unavailable"
    finally:
        await client.close()
    assert not is_retryable(EngineDeadError("gone")) and not is_retryable(ValueError("a bug"))


async def test_5xx_and_exhausted_503s_are_unavailable():
    """A server answering 500, 502 or 429 is unavailable at once; one answering 503 (paused) is waited on until
    ``request_timeout_s``, then unavailable. Both retryable, neither a request error."""
    from aiohttp import web

    from rollflow.http.errors import json_error

    status = {"value": 500}

    async def answer(request: web.Request) -> web.Response:
        return json_error(status["value"], "no")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = RemoteInferenceClient(f"http://127.0.0.1:{port}", request_timeout_s=0.5)
    try:
        for value in (500, 502, 429, 503):
            status["value"] = value
            with pytest.raises(InferenceUnavailableError) as raised:
                await client.generate(GenerateRequest([1], SamplingParams(max_tokens=1)))
            assert is_retryable(raised.value) and not isinstance(raised.value, EngineError)
    finally:
        await client.close()
        await runner.cleanup()


# ------------------------------------------------------------------ one JSON error body


async def test_server_router_and_proxy_answer_an_overlong_prompt_with_the_same_type_and_code(
    router, inference_servers, tiny_chat
):
    long_ids = {"token_ids": [5] * MAX_MODEL_LEN, "sampling_params": {"max_tokens": 2}}
    remote = RemoteInferenceClient(router.url, inference_servers.urls)
    bodies = []
    try:
        async with aiohttp.ClientSession() as http:
            for url in (inference_servers.urls[0], router.url):
                async with http.post(f"{url}/inference/v1/generate", json=long_ids) as response:
                    bodies.append((response.status, (await response.json())["error"]))
            async with TITOProxy(remote, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL) as proxy:
                session = await proxy.open_session("long")
                messages = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
                url = f"{session.base_url}/chat/completions"
                async with http.post(url, json={"model": MODEL, "messages": messages}) as response:
                    bodies.append((response.status, (await response.json())["error"]))
                trace = await proxy.close_session(session)
    finally:
        await remote.close()
    assert {(status, error["type"], error["code"]) for status, error in bodies} == {
        (400, "BadRequestError", CONTEXT_LENGTH_EXCEEDED)
    }
    assert all(set(error) == {"message", "type", "param", "code"} and error["message"] for _, error in bodies)
    assert trace.stats.context_exceeded == 1 and not trace.errors  # the agent's fault, not an outage


# ------------------------------------------------------------------ the barrier retries only what is retryable


class FailingTransfer:
    """A transfer whose first ``failures`` pushes raise ``error``."""

    def __init__(self, error: BaseException, failures: int = 1):
        self.error, self.failures, self.pushes = error, failures, 0

    async def push(self, client, trainer, policy_version):
        self.pushes += 1
        if self.pushes <= self.failures:
            raise self.error

    async def verify(self, client, trainer, policy_version):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(
    ("error", "pushes"),
    [
        (WeightTransferError("trainer rank 0: the peer reset the connection"), 2),  # reconnect and retry
        (WeightTransferTimeoutError("the group never formed"), 1),
        (ValueError("a bug in the transfer"), 1),
        (EngineError("update_info names an unknown tensor"), 1),
    ],
    ids=["transfer", "timeout", "bug", "refused"],
)
async def test_the_barrier_retries_only_retryable_failures(local_engine, error, pushes):
    client = LocalInferenceClient([local_engine])
    transfer = FailingTransfer(error)
    barrier = WeightBarrier(client, transfer, timeout_s=10)
    if pushes == 2:
        await barrier.update(StaticWeights(list), policy_version=0, pause_mode="wait")
    else:
        with pytest.raises(TimeoutError if isinstance(error, TimeoutError) else type(error)):
            await barrier.update(StaticWeights(list), policy_version=0, pause_mode="wait")
    assert transfer.pushes == pushes
    assert not await client.is_paused()


# ------------------------------------------------------------------ an agent's over-long prompt, both modes


async def overlong_agent(base_url, task):
    """One short turn, then a tool result that no context holds: the agent reads the error's code (as
    agent libraries do) and ends its episode."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        messages = list(task.messages)
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, seed=task.seed, max_tokens=6
        )
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "result: " + "word " * MAX_MODEL_LEN}]
        try:
            await client.chat.completions.create(model=task.model, messages=messages, seed=task.seed + 1)
        except openai.BadRequestError as error:
            assert error.code == CONTEXT_LENGTH_EXCEEDED, error
            return 0.5
    raise AssertionError("the over-long prompt was served")


async def _overlong_group(client, tiny_chat):
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=6
    ) as proxy:
        generator = AgentGenerator(proxy, overlong_agent, max_seq_len=MAX_MODEL_LEN, timeout_s=60, seed=3)
        rollout = RolloutRequest(
            prompt_index=0, messages=[{"role": "user", "content": "name a fruit"}], answer=1, num_samples=2
        )
        return await generator.generate_group(rollout)


async def test_an_overlong_agent_prompt_gives_the_same_samples_and_metrics_in_local_and_http_mode(
    local_engine, router, inference_servers, tiny_chat
):
    local = await _overlong_group(LocalInferenceClient([local_engine]), tiny_chat)
    remote = RemoteInferenceClient(router.url, inference_servers.urls)
    try:
        http = await _overlong_group(remote, tiny_chat)
    finally:
        await remote.close()
    assert local.metrics == http.metrics
    assert local.metrics["agent_context_exceeded"] == 2 and local.metrics["agent_errors"] == 0
    assert len(local.samples) == len(http.samples) == 2
    for ours, theirs in zip(local.samples, http.samples, strict=True):
        assert not ours.masked and ours.reward == 0.5 and sum(ours.loss_mask) > 0
        for field in (
            "prompt_token_ids",
            "completion_token_ids",
            "loss_mask",
            "reward",
            "masked",
            "mask_reason",
        ):
            assert getattr(ours, field) == getattr(theirs, field), field
        # The same tokens; logprobs agree to float32 noise (batch composition and the prefix cache change the
        # last bits, within one engine too).
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


# ------------------------------------------------------------------ the data plane's backoff has jitter


async def test_data_plane_backoff_is_jittered(monkeypatch):
    """Thousands of requests refused at once (a restarting server) must not retry in lockstep: each wait is
    its nominal backoff scaled into [0.5, 1)."""
    from rollflow.inference import remote_retry

    jittered = [remote_retry.jittered(0.2) for _ in range(200)]
    assert all(0.1 <= wait < 0.2 for wait in jittered) and len(set(jittered)) > 150
    nominal: list[float] = []

    def record(delay: float) -> float:
        nominal.append(delay)
        return 0.0

    monkeypatch.setattr(remote_retry, "jittered", record)
    retry = remote_retry.DataRetry("POST", "http://127.0.0.1:1/x", timeout_s=60, connect_retries=2)
    await retry.after_connection_error(ConnectionRefusedError())
    await retry.while_paused()
    await retry.after_connection_error(ConnectionRefusedError())
    await retry.while_paused()
    assert nominal == [0.2, 0.02, 0.4, 0.04]  # both waits go through the jitter
    with pytest.raises(InferenceUnavailableError, match="3 connection attempts"):
        await retry.after_connection_error(ConnectionRefusedError())
