"""``inference.api_key``: config validation, and the bearer token through client, router and a real server."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp
import pytest

from rollflow.config import build_config, resolve_api_key
from rollflow.errors import ConfigError
from rollflow.inference.remote import ControlPlaneError, RemoteInferenceClient, RemoteInferenceError
from rollflow.inference.router import InferenceRouter
from rollflow.launch.server_group import build_torch_server_command, build_vllm_server_command
from rollflow.messages import GenerateRequest, SamplingParams

KEY = "s3cret-key"
GENERATE = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}}


def http_config(tmp_path, **inference):
    return build_config(
        {
            "output_dir": str(tmp_path),
            "inference": {"mode": "http", "router_port": 0, "health_check_interval_s": 0.5, **inference},
        }
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (123, r"'inference.api_key': Expected `str \| null`, got `int`"),
        (["k"], r"Expected `str \| null`, got `array`"),
        ("", "inference.api_key must be a non-empty token"),
        ("two words", "inference.api_key must be a non-empty token without spaces"),
        ("line\nbreak", "without spaces or line breaks"),
    ],
)
def test_api_key_config_rejects_wrong_values(value, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"inference": {"mode": "http", "api_key": value}})


def test_api_key_comes_from_config_else_the_environment(monkeypatch):
    monkeypatch.delenv("ROLLFLOW_API_KEY", raising=False)
    assert resolve_api_key(build_config({}).inference) is None
    monkeypatch.setenv("ROLLFLOW_API_KEY", "from-env")
    assert resolve_api_key(build_config({}).inference) == "from-env"
    assert resolve_api_key(build_config({"inference": {"api_key": "from-config"}}).inference) == "from-config"


def test_server_commands_pass_the_key_in_their_environment_not_their_argv():
    argv, env = build_torch_server_command("rollflow:tiny", port=0, api_key=KEY)
    assert env == {"ROLLFLOW_API_KEY": KEY} and KEY not in " ".join(argv)
    argv, env = build_vllm_server_command("some/model", port=8000, api_key=KEY)
    assert env["VLLM_API_KEY"] == KEY and KEY not in " ".join(argv)
    assert build_torch_server_command("rollflow:tiny", port=0)[1] == {}


async def status_of(http, method, url, key=None, body=None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with http.request(method, url, json=body, headers=headers) as response:
        payload = await response.json(content_type=None)
        return response.status, payload


async def assert_guarded(http, base_url, method, path, body=None):
    """Missing key and wrong key: 401 with the JSON error; right key: 200."""
    for key in (None, "wrong"):
        status, payload = await status_of(http, method, f"{base_url}{path}", key, body)
        assert status == 401, (path, key, payload)
        assert payload["error"]["code"] == "unauthorized" and "bearer token" in payload["error"]["message"]
    status, payload = await status_of(http, method, f"{base_url}{path}", KEY, body)
    assert status == 200, (path, payload)


@pytest.mark.slow
@pytest.mark.http_only(reason="the API key on servers, router and client")
async def test_key_guards_client_router_and_servers(tmp_path, monkeypatch):
    """rollflow starts a server and a router with the key; the client sends it; both refuse calls without it
    (except /health and /metrics), and a key-less router in front still forwards the caller's header."""
    from rollflow.inference.setup import get_inference_client

    monkeypatch.delenv("ROLLFLOW_API_KEY", raising=False)
    config = http_config(tmp_path, num_servers=1, max_batch_size=4, api_key=KEY, router="always")
    request = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=2))
    async with get_inference_client(config) as client, aiohttp.ClientSession() as http:
        assert isinstance(client, RemoteInferenceClient) and client.api_key == KEY
        # Through the client: data plane via the router, control plane to the server.
        assert len((await client.generate(request)).token_ids) == 2
        assert await client.get_world_size() == 1
        await client.pause("keep")
        await client.resume()

        router_url, (server_url,) = client.data_url, client.server_urls
        for base in (router_url, server_url):
            await assert_guarded(http, base, "POST", "/inference/v1/generate", GENERATE)
            await assert_guarded(http, base, "GET", "/v1/models")
            for path in ("/health", "/metrics"):  # probes and scrapers carry no secret
                async with http.get(f"{base}{path}") as response:
                    assert response.status == 200, (base, path)
        await assert_guarded(http, router_url, "GET", "/list_workers")
        await assert_guarded(http, router_url, "GET", "/get_world_size")  # fanned out, key sent on
        await assert_guarded(http, server_url, "POST", "/resume")
        await assert_guarded(http, server_url, "GET", "/is_paused")

        # A client with the wrong key: 401 on both planes, named, not retried.
        wrong = RemoteInferenceClient(router_url, [server_url], api_key="wrong", request_timeout_s=10)
        with pytest.raises(RemoteInferenceError) as data_error:
            await wrong.generate(request)
        assert data_error.value.status == 401
        with pytest.raises(ControlPlaneError, match=f"{server_url}.*HTTP 401"):
            await wrong.pause("keep")
        await wrong.close()

        # A router without a key of its own forwards the caller's Authorization header to the server.
        async with InferenceRouter([server_url], health_check_interval_s=60) as open_router:
            await assert_guarded(http, open_router.url, "POST", "/inference/v1/generate", GENERATE)


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_router_cli_takes_the_key_from_the_flag_or_the_environment(how):
    argv = [sys.executable, "-m", "rollflow", "router", "--port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLOW_API_KEY"}
    if how == "flag":
        argv += ["--api-key", KEY]
    else:
        env["ROLLFLOW_API_KEY"] = KEY
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
    )
    try:
        event = json.loads(await asyncio.wait_for(process.stdout.readline(), 60))
        async with aiohttp.ClientSession() as http:
            await assert_guarded(http, event["url"], "GET", "/list_workers")
            async with http.get(f"{event['url']}/metrics") as response:
                assert response.status == 200
    finally:
        process.kill()
        await process.wait()
