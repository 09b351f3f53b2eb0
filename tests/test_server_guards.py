"""Engine servers behind the real router, attacked through HTTP: extreme sampling values, non-finite weights
through the real weight-update path, and an engine that died.

The servers are ``EngineServer``s (the code ``rollflow serve`` runs) started in this process on loopback, so a
test can kill one's engine by calling ``TorchEngine._die`` (a test-only means: nothing a request or a weight
update sends reaches it any more). The router is a real ``InferenceRouter``; weights travel by the
``checkpoint`` strategy's sender and the servers' real receivers.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time

import aiohttp
import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file

from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.remote import RemoteEngineDeadError, RemoteInferenceClient
from rollflow.inference.router import WORKER_HEADER, InferenceRouter
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rollflow.weights import StaticWeights, connect_sender, create_strategy

from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="servers and the router facing bad input and dead engines"),
]

HEALTH_INTERVAL_S = 0.5
PROMPT = [5, 17, 300, 42, 9]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SESSIONS = [f"session-{i}" for i in range(16)]


@pytest.fixture(scope="module")
def model_parts():
    model_dir = resolve_model_path("rollflow:tiny")
    model = load_causal_lm(model_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # re-drawn weights: greedy continuations vary token to token
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3, generator=generator)
    return load_tokenizer(model_dir), model


async def start_servers(model_parts, count: int) -> list[EngineServer]:
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer

    tokenizer, model = model_parts
    servers = []
    for _ in range(count):
        engine = TorchEngine(copy.deepcopy(model), max_batch_size=4, max_model_len=256)
        server = EngineServer(
            engine,
            tokenizer,
            served_model_name="tiny",
            renderer=create_chat_renderer(tokenizer, ModelConfig()),
            eos_token_ids=(tokenizer.eos_token_id,),
        )
        await server.start()
        servers.append(server)
    return servers


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(model_parts):
    """Two servers and a router over them, shared by the tests that leave every engine alive."""
    servers = await start_servers(model_parts, 2)
    router = InferenceRouter([s.url for s in servers], health_check_interval_s=HEALTH_INTERVAL_S)
    await router.start()
    yield servers, router
    await router.stop()
    for server in servers:
        await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def post(
    http, url: str, body: dict | bytes, headers: dict | None = None
) -> tuple[int, dict, str | None]:
    """POST ``body`` (a dict as JSON, or raw JSON bytes); returns status, decoded body and the answering worker."""
    if isinstance(body, bytes):
        kwargs = {"data": body, "headers": {"Content-Type": "application/json", **(headers or {})}}
    else:
        kwargs = {"json": body, "headers": headers}
    async with http.post(url, **kwargs) as response:
        return response.status, await response.json(content_type=None), response.headers.get(WORKER_HEADER)


async def greedy(http, url: str, session_id: str | None = None) -> tuple[list[int], str | None]:
    headers = {"X-Session-ID": session_id} if session_id else None
    body = {"token_ids": PROMPT, "sampling_params": GREEDY}
    status, out, worker = await post(http, f"{url}/inference/v1/generate", body, headers)
    assert status == 200, out
    return out["choices"][0]["token_ids"], worker


async def owners(http, router: InferenceRouter) -> dict[str, str]:
    return {session: (await greedy(http, router.url, session))[1] for session in SESSIONS}


# ---------------------------------------------------------------------------- extreme sampling values

# (field, raw JSON value). 1e999 decodes to inf; 2**63 and 2**64 are outside int64.
REFUSED = [
    ("temperature", "1e-300"),
    ("temperature", "5e-324"),
    ("temperature", "1e-45"),
    ("temperature", "1e-38"),
    ("temperature", "1e-6"),
    ("temperature", "1e5"),
    ("temperature", "1e300"),
    ("temperature", "1e999"),
    ("temperature", "-1e-300"),
    ("top_p", "1e-300"),
    ("top_p", "1e-45"),
    ("top_p", "0"),
    ("top_p", "1e-9"),
    ("top_p", "1.0000001"),
    ("top_p", "-1e999"),
    ("top_k", "-2"),
    ("top_k", "9223372036854775808"),
    ("max_tokens", "0"),
    ("max_tokens", "-1"),
    ("max_tokens", "1000000000000000000"),
    ("seed", "-1"),
    ("seed", "18446744073709551616"),
    ("logit_bias", '{"5": 1e999}'),
    ("logit_bias", '{"5": -100}'),
]
ACCEPTED = [
    {"temperature": 1e-5, "top_p": 1e-8, "seed": 1},
    {"temperature": 1e4, "top_k": 2**62},
    {"temperature": 1e-5, "top_k": 1, "seed": 2**63 - 65},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_tokens": 1},
]
# Each endpoint's body around its sampling fields (raw JSON, so that 1e999 and huge integers reach the server).
ENDPOINTS = {
    "/inference/v1/generate": ('{"token_ids": [5, 6, 7], "sampling_params": {', "}}"),
    "/v1/completions": ('{"prompt": [5, 6, 7], ', "}"),
    "/v1/chat/completions": ('{"messages": [{"role": "user", "content": "hi"}], ', "}"),
}


def raw_body(path: str, fields: dict[str, str]) -> bytes:
    opening, closing = ENDPOINTS[path]
    fields = {"max_tokens": "2", **fields}
    return (opening + ", ".join(f'"{key}": {value}' for key, value in fields.items()) + closing).encode()


async def test_extreme_sampling_values_get_400s_naming_the_field_and_the_engines_keep_serving(fleet, http):
    servers, router = fleet
    before = await greedy(http, router.url)
    pinned = await owners(http, router)
    refused = 0
    for path in ENDPOINTS:
        for field, raw in REFUSED:
            status, out, _ = await post(http, router.url + path, raw_body(path, {field: raw}))
            assert status == 400, (path, field, raw, out)
            assert field in (out["error"]["param"] or ""), (path, field, raw, out)
            refused += 1
        # Accepted extremes sample, concurrently with each other (batched in one engine step).
        bodies = [raw_body(path, {k: str(v) for k, v in fields.items()}) for fields in ACCEPTED]
        results = await asyncio.gather(*(post(http, router.url + path, body) for body in bodies))
        assert [status for status, _, _ in results] == [200] * len(ACCEPTED), results
    assert refused == len(REFUSED) * len(ENDPOINTS)
    # Every engine still serves: the same greedy tokens, every session on the server it was pinned to.
    assert (await greedy(http, router.url))[0] == before[0]
    assert await owners(http, router) == pinned
    assert not any(server.engine.is_dead for server in servers)
    assert all(row["healthy"] for row in router.worker_table())


async def test_nan_in_the_json_is_a_400(fleet, http):
    _, router = fleet
    status, out, _ = await post(
        http, f"{router.url}/v1/completions", b'{"prompt": [5], "max_tokens": 2, "temperature": NaN}'
    )
    assert status == 400 and out["error"]["type"] == "BadRequestError"


# ---------------------------------------------------------------------------- non-finite weights


async def test_non_finite_weights_are_refused_by_name_through_the_real_update_path(
    fleet, http, model_parts, tmp_path
):
    """The trainer's checkpoint sender pushes weights with a NaN and an inf to both servers: every server
    refuses them with a 400 naming the tensors, the old weights keep serving (same greedy tokens, same policy
    version), and the next push of finite weights succeeds."""
    servers, router = fleet
    _, model = model_parts
    before = await greedy(http, router.url)
    client = RemoteInferenceClient(router.url, [s.url for s in servers], control_timeout_s=60)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    poisoned = dict(state)
    poisoned["model.layers.1.self_attn.q_proj.weight"] = state[
        "model.layers.1.self_attn.q_proj.weight"
    ].clone()
    poisoned["model.layers.1.self_attn.q_proj.weight"][2, 3] = math.nan
    poisoned["model.norm.weight"] = state["model.norm.weight"].clone()
    poisoned["model.norm.weight"][0] = math.inf
    strategy = create_strategy("checkpoint", checkpoint_dir=tmp_path / "ckpt", timeout_s=60)
    async with client:
        poisoned_source = StaticWeights(poisoned.items)
        sender = await connect_sender(strategy, client.control, poisoned_source)
        try:
            with pytest.raises(
                Exception, match=r"400.*inf or NaN.*self_attn\.q_proj\.weight, model\.norm\.weight"
            ) as info:
                await sender.push(client.control, poisoned_source, policy_version=1)
            assert all(s.url in str(info.value) for s in servers)  # both refused, each named
        finally:
            sender.close()
        assert {s.engine.policy_version for s in servers} == {0}
        assert (await greedy(http, router.url))[0] == before[0]
        source = StaticWeights(state.items)
        sender = await connect_sender(
            strategy, client.control, source
        )  # what the trainer does after a failed push
        try:
            await sender.push(client.control, source, policy_version=1)
        finally:
            sender.close()
    assert {s.engine.policy_version for s in servers} == {1}
    assert (await greedy(http, router.url))[0] == before[0]


async def test_non_finite_weights_in_a_file_are_refused_over_http(fleet, http, model_parts, tmp_path):
    """The same refusal on the raw endpoints (``/update_weights`` with a safetensors path), with the JSON error
    naming ``update_info``; a finished round leaves the version where it was."""
    servers, _ = fleet
    _, model = model_parts
    server = servers[0]
    version = server.engine.policy_version
    path = tmp_path / "bad.safetensors"
    weight = model.state_dict()["model.embed_tokens.weight"].clone()
    weight[7] = -math.inf
    save_file({"model.embed_tokens.weight": weight}, str(path))
    status, _, _ = await post(
        http, f"{server.url}/init_weight_transfer_engine", {"init_info": {"backend": "checkpoint"}}
    )
    assert status == 200
    assert (await post(http, f"{server.url}/start_weight_update", {}))[0] == 200
    status, out, _ = await post(
        http, f"{server.url}/update_weights", {"update_info": {"path": str(path), "policy_version": 9}}
    )
    assert status == 400 and out["error"]["param"] == "update_info"
    assert "model.embed_tokens.weight" in out["error"]["message"]
    assert server.engine.policy_version == version and not server.engine.is_dead


# ---------------------------------------------------------------------------- a dead engine


async def test_dead_engine_is_distinct_from_paused(model_parts, http):
    (server,) = await start_servers(model_parts, 1)
    try:
        async with http.post(f"{server.url}/pause?mode=abort") as response:
            assert response.status == 200
        async with http.get(f"{server.url}/health") as response:
            assert response.status == 200  # paused is alive
        status, out, _ = await post(http, f"{server.url}/inference/v1/generate", {"token_ids": [5]})
        assert status == 503 and out["error"]["type"] == "ServiceUnavailableError"
        server.engine._die(RuntimeError("test-only: engine killed"))
        async with http.get(f"{server.url}/health") as response:
            body = await response.json()
            assert response.status == 503 and body["error"]["type"] == "EngineDeadError"
        status, out, _ = await post(http, f"{server.url}/inference/v1/generate", {"token_ids": [5]})
        assert status == 503 and out["error"]["type"] == "EngineDeadError"  # checked before "paused"
        assert "restart" in out["error"]["message"]
        async with http.get(f"{server.url}/metrics") as response:
            assert "rollflow:engine_dead{" in (text := await response.text()) and 'tiny"} 1' in text
        # A client stops at once, where a pause would be waited out for request_timeout_s.
        client = RemoteInferenceClient(server.url, request_timeout_s=60)
        async with client:
            started = time.monotonic()
            with pytest.raises(RemoteEngineDeadError, match="engine is dead"):
                await client.generate(GenerateRequest([5, 6], SamplingParams(max_tokens=2)))
            assert time.monotonic() - started < 30  # generous, for a loaded machine; far below 60 s
    finally:
        await server.close()


async def test_router_takes_a_dead_engine_out_within_one_health_interval_and_moves_its_sessions(
    model_parts, http
):
    """Two servers behind the router, sessions pinned to both; one server's engine is killed (``_die``, test
    only) while its HTTP server keeps answering. The health probe takes it out within one interval, its
    sessions move to the other server, no request after that gets a 503, and the router counts it."""
    servers = await start_servers(model_parts, 2)
    router = InferenceRouter([s.url for s in servers], health_check_interval_s=HEALTH_INTERVAL_S)
    await router.start()
    try:
        before = await greedy(http, router.url)
        pinned = await owners(http, router)
        victim = next(s for s in servers if s.url in pinned.values())
        survivor = next(s for s in servers if s is not victim)
        moved = [session for session, owner in pinned.items() if owner == victim.url]
        assert moved and len(moved) < len(SESSIONS), pinned

        victim.engine._die(RuntimeError("test-only: engine killed"))
        killed_at = time.monotonic()
        await wait_until(lambda: not router.workers[victim.url].healthy, "the dead engine is taken out")
        taken_out_s = time.monotonic() - killed_at
        print(
            f"dead engine taken out of rotation after {taken_out_s:.3f} s (health interval {HEALTH_INTERVAL_S} s)"
        )
        assert taken_out_s <= HEALTH_INTERVAL_S + 10, taken_out_s  # about one interval; generous, for load

        statuses = []
        for session in SESSIONS:
            body = {"token_ids": PROMPT, "sampling_params": GREEDY}
            status, out, worker = await post(
                http, f"{router.url}/inference/v1/generate", body, {"X-Session-ID": session}
            )
            statuses.append(status)
            assert worker == survivor.url, (session, worker)
            assert out["choices"][0]["token_ids"] == before[0]
        print(
            f"{len(moved)} sessions were pinned to the dead engine; answers after it was taken out: "
            f"{statuses.count(503)} x 503, {statuses.count(200)} x 200"
        )
        assert statuses.count(503) == 0 and set(statuses) == {200}
        table = {row["url"]: row for row in router.worker_table()}
        assert table[victim.url]["engine_dead"] and table[victim.url]["sessions"] == 0
        assert table[survivor.url]["sessions"] == len(SESSIONS)
        async with http.get(f"{router.url}/metrics") as response:
            assert "rollflow_router_dead_engines_total 1" in await response.text()
        # The control plane carries on with the live server, as it does when a server is unreachable.
        client = RemoteInferenceClient(
            router.url, [s.url for s in servers], control_timeout_s=30, drop_unreachable_servers=True
        )
        async with client:
            await client.pause("keep")
            await client.resume()
            assert client.server_urls == [survivor.url]
    finally:
        await router.stop()
        for server in servers:
            await server.close()


async def test_a_proxied_request_that_meets_a_dead_engine_is_retried_elsewhere(model_parts, http):
    """Before any probe (a fresh router counts both servers healthy), requests of sessions hashed to the server
    whose engine died get 200s from the other; once every engine is dead the router says so, and a client
    raises instead of waiting for a resume."""
    servers = await start_servers(model_parts, 2)
    servers[0].engine._die(RuntimeError("test-only: engine killed"))
    router = InferenceRouter([s.url for s in servers], health_check_interval_s=3600)
    await router.start()
    try:
        body = {"token_ids": PROMPT, "sampling_params": GREEDY}
        results = [
            await post(http, f"{router.url}/inference/v1/generate", body, {"X-Session-ID": s})
            for s in SESSIONS
        ]
        assert [status for status, _, _ in results] == [200] * len(SESSIONS)
        assert {worker for _, _, worker in results} == {servers[1].url}
        assert router.num_dead_engines == 1 and not router.workers[servers[0].url].healthy

        servers[1].engine._die(RuntimeError("test-only: engine killed"))
        status, out, _ = await post(http, f"{router.url}/inference/v1/generate", {"token_ids": PROMPT})
        assert status == 503 and out["error"]["type"] == "EngineDeadError", out
        client = RemoteInferenceClient(router.url, request_timeout_s=60)
        async with client:
            started = time.monotonic()
            with pytest.raises(RemoteEngineDeadError):
                await client.generate(GenerateRequest([5, 6], SamplingParams(max_tokens=2)))
            assert time.monotonic() - started < 30  # generous, for a loaded machine; far below 60 s
    finally:
        await router.stop()
        for server in servers:
            await server.close()
