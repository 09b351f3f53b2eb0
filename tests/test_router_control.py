"""The router as the whole control plane ("proxy only"): control calls fan out to two real ``rollflow serve``
servers, answers are combined, failures name the worker, and a broadcast gets a rank_offset per worker."""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio
import torch

from rollflow.errors import error_code
from rollflow.inference.remote import ControlPlaneError, RemoteInferenceClient
from rollflow.inference.router import InferenceRouter
from rollflow.launch.server_group import free_port
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.weights import StaticWeights, connect_sender, create_strategy

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="the router's control-plane fan-out"),
]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers of this module's own: it pushes weights and sleeps them, which the shared ones must not."""
    from .helpers.servers import BackgroundServerGroup

    group = BackgroundServerGroup(2, tmp_path_factory.mktemp("router-control"))
    yield group
    group.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(servers):
    async with InferenceRouter(servers.urls, health_check_interval_s=0.5) as router:
        yield router


@pytest_asyncio.fixture(loop_scope="module")
async def client(router):
    """Proxy only: the router is the data plane and the whole control plane."""
    async with RemoteInferenceClient(router.url, control_timeout_s=60, request_timeout_s=60) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def call(http, method, url, body=None):
    async with http.request(method, url, json=body) as response:
        return response.status, await response.json()


async def each_server(http, servers, path):
    return [(await call(http, "GET", f"{url}{path}"))[1] for url in servers.urls]


@pytest.mark.slow
async def test_state_calls_reach_every_worker_and_combine(client, router, servers, http):
    assert client.server_urls == [router.url]
    assert await client.get_world_size() == 2  # summed over the workers, not one server's 1
    status, body = await call(http, "GET", f"{router.url}/get_world_size")
    assert status == 200 and body["world_size"] == 2 and set(body["workers"]) == set(servers.urls)

    await client.pause("keep")
    assert [b["is_paused"] for b in await each_server(http, servers, "/is_paused")] == [True, True]
    assert await client.is_paused()
    await client.resume()
    assert [b["is_paused"] for b in await each_server(http, servers, "/is_paused")] == [False, False]
    assert not await client.is_paused()

    await client.control.sleep(level=1)
    assert [b["is_sleeping"] for b in await each_server(http, servers, "/is_sleeping")] == [True, True]
    assert await client.is_sleeping()
    await client.control.wake_up()
    assert not await client.is_sleeping()

    await client.reset_prefix_cache()
    assert await client.abort() == 0
    status, body = await call(http, "GET", f"{router.url}/weight_info")
    assert status == 200 and body["weight_version"] == "0" and len(body["workers"]) == 2
    assert len((await client.generate(GenerateRequest([5, 6, 7], GREEDY))).token_ids) == 6


async def test_broadcast_through_the_router_gives_each_worker_its_ranks(
    client, router, servers, tiny_model_dir
):
    """One init_info to the router: it rewrites rank_offset to 1 and 2, so both workers join one gloo group."""
    from rollflow.models.loading import load_causal_lm

    prompt = GenerateRequest([5, 17, 42, 99, 3], GREEDY)
    per_server = [RemoteInferenceClient(url) for url in servers.urls]
    try:
        before = [(await server.generate(prompt)).token_ids for server in per_server]
        model = load_causal_lm(tiny_model_dir)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
        strategy = create_strategy("broadcast", backend="gloo", bucket_size_mb=0.25, timeout_s=60)
        source = StaticWeights(lambda: model.state_dict().items())
        sender = await connect_sender(strategy, client.control, source)
        try:
            assert sender.init_info["world_size"] == 3
            await client.pause("keep")
            try:
                await sender.push(client.control, source, policy_version=5)
            finally:
                await client.resume()
        finally:
            sender.close()
        outputs = [await server.generate(prompt) for server in per_server]
        assert outputs[0].token_ids == outputs[1].token_ids != before[0]
        assert {v for output in outputs for v in output.policy_versions} == {5}
        assert (await client.weight_info())[router.url]["weight_version"] == "5"
    finally:
        for server in per_server:
            await server.close()


BAD_CONTROL_CALLS = [
    # (method, path, body, status, text in the message)
    ("POST", "/pause?mode=bogus", None, 400, "mode"),
    ("POST", "/sleep?level=seven", None, 400, "level"),
    ("POST", "/wake_up?tags=everything", None, 400, "tags"),
    ("POST", "/reset_prefix_cache?reset_running_requests=maybe", None, 400, "reset_running_requests"),
    ("GET", "/get_world_size?include_dp=perhaps", None, 400, "include_dp"),
    ("POST", "/abort_requests", {"request_ids": "all"}, 400, "request_ids"),
    ("POST", "/update_weights", {"update_info": {"names": []}}, 400, "start_weight_update must be called"),
    ("POST", "/finish_weight_update", None, 400, "start_weight_update must be called"),
    ("POST", "/init_weight_transfer_engine", {"init_info": "gloo"}, 400, "init_info"),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": [{"rank_offset": 1}]},
        400,
        "not a list per server",
    ),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": {"backend": "gloo", "rank_offset": "1", "world_size": 3}},
        400,
        "rank_offset ('1') must be an integer",
    ),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": {"backend": "gloo", "rank_offset": 1, "world_size": 2, "master_address": "127.0.0.1"}},
        400,
        "world_size 2 cannot hold ranks 1..2",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "text"), BAD_CONTROL_CALLS)
async def test_bad_control_calls_are_4xx_naming_each_worker(
    router, servers, http, method, path, body, status, text
):
    got, answer = await call(http, method, f"{router.url}{path}", body)
    assert got == status, answer
    assert answer["error"]["code"] == error_code(status) and text in answer["error"]["message"]
    if "failed on" in answer["error"]["message"]:  # the servers' own refusal: each one named
        assert all(url in answer["error"]["message"] for url in servers.urls)


async def test_not_json_init_body_is_a_400(router, http):
    async with http.post(f"{router.url}/init_weight_transfer_engine", data=b"{oops") as response:
        assert response.status == 400 and "not valid JSON" in (await response.json())["error"]["message"]


async def test_unreachable_worker_is_named_then_left_out(servers, http):
    dead = f"http://127.0.0.1:{free_port()}"
    async with InferenceRouter([*servers.urls, dead], health_check_interval_s=60) as router:
        proxy_only = RemoteInferenceClient(router.url, control_timeout_s=30)
        with pytest.raises(ControlPlaneError, match=rf"failed on 1 of 3 worker\(s\): {dead}: unreachable"):
            await proxy_only.resume()
        assert await proxy_only.get_world_size() == 2  # the dead worker was taken out by the failure
        await proxy_only.close()
        status, answer = await call(http, "POST", f"{router.url}/resume")
        assert status == 200 and set(answer["workers"]) == set(servers.urls)
        assert answer["skipped"] == {dead: "unhealthy: its health probes fail"}  # said, not hidden
    async with InferenceRouter([dead], health_check_interval_s=60) as router:
        assert (await call(http, "POST", f"{router.url}/resume"))[0] == 502
        status, answer = await call(http, "POST", f"{router.url}/resume")
        assert status == 503 and "no healthy inference server" in answer["error"]["message"]
        assert f"{dead}': 'unhealthy" in answer["error"]["message"]
