"""Slow clients and the connection cap (``rollflow.http.runner``): real loopback servers, raw sockets.

A connection that stalls in its request line, headers or body gets a 408 JSON error and is closed once its
timeout passes; an idle kept-alive connection is closed too; beyond ``max_connections`` a request gets 503.
The last test holds 50 stalled connections against the engine server and checks that it keeps answering.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from rollflow.http.auth import is_loopback
from rollflow.http.limits import HttpLimits, limits_from_flags
from rollflow.http.runner import JSONErrorAppRunner
from tests.helpers.tito import MODEL, ScriptedClient
from tests.helpers.waits import wait_until

TIMEOUT_S = 0.5
# How long a test waits for an answer, and the most a timeout may overshoot: generous, for a loaded machine
# (far below aiohttp's own 75 s keep-alive, so a connection closed by its timeout still tells).
READ_WITHIN_S = 60.0
LATE_S = 10.0


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"received": len(body)})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _serve(limits: HttpLimits):
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_get("/health", _health)
    runner = JSONErrorAppRunner(app, limits=limits, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port


async def _read_reply(
    reader: asyncio.StreamReader, within_s: float, since: float | None = None
) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long since ``since`` (a ``time.perf_counter()``
    taken before connecting: the server's timers cannot start earlier, so a lower bound on the wait holds
    however late this runs) or, without it, since this call."""
    started = time.perf_counter() if since is None else since
    data = await asyncio.wait_for(reader.read(), within_s)
    return data, time.perf_counter() - started


def _status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    ("sent", "phase"),
    [
        (b"", "request line and headers"),
        (b"POST /ec", "request line and headers"),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Len", "request line and headers"),
        (b'POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"a":', "request body"),
    ],
    ids=["nothing", "request-line", "headers", "body"],
)
async def test_stalled_request_gets_408_after_its_timeout(sent: bytes, phase: str):
    runner, port = await _serve(HttpLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S))
    try:
        connecting = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        reply, waited = await _read_reply(reader, within_s=READ_WITHIN_S, since=connecting)
        status, body = _status_and_json(reply)
        assert status == 408
        assert phase in body["error"]["message"]
        assert body["error"]["type"] == "RequestTimeoutError"
        assert TIMEOUT_S * 0.8 <= waited < TIMEOUT_S + LATE_S
        assert reader.at_eof()
        writer.close()
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_slow_but_steady_body_within_its_timeout_is_served():
    # The body timeout bounds the whole body: ten times the 1 s its gaps add up to, for a loaded machine.
    runner, port = await _serve(HttpLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=20 * TIMEOUT_S))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        for byte in b"abcd":  # each gap, and their total, shorter than the body timeout
            await asyncio.sleep(TIMEOUT_S / 2)
            writer.write(bytes([byte]))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply, _ = await _read_reply(reader, within_s=READ_WITHIN_S)
        assert reply.count(b"HTTP/1.1 200") == 2
        assert b'"received":4' in reply.replace(b" ", b"")
        writer.close()
    finally:
        await runner.cleanup()


async def test_idle_kept_alive_connection_is_closed():
    runner, port = await _serve(HttpLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S))
    try:
        connecting = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply, waited = await _read_reply(reader, within_s=READ_WITHIN_S, since=connecting)
        assert reply.startswith(b"HTTP/1.1 200")
        assert waited >= TIMEOUT_S * 0.8  # served at once, then held open until idle for the timeout
        writer.close()
    finally:
        await runner.cleanup()


async def test_connections_beyond_the_cap_get_503():
    runner, port = await _serve(HttpLimits(header_timeout_s=5.0, body_timeout_s=5.0, max_connections=3))
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await wait_until(lambda: len(runner.server.connections) == 3, "the server accepts the three")
        async with (
            aiohttp.ClientSession() as client,
            client.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            assert response.status == 503
            body = await response.json()
        assert body["error"]["code"] == "service_unavailable"
        assert "max_connections" in body["error"]["message"]
        for _, writer in held:
            writer.close()
        await wait_until(lambda: len(runner.server.connections) < 3, "the server sees connections close")
        async with (  # below the cap again: served
            aiohttp.ClientSession() as client,
            client.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            assert response.status == 200
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"header_timeout_s": 0.0}, "header_timeout_s"),
        ({"body_timeout_s": float("nan")}, "body_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_bad_limits_name_the_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        HttpLimits(**kwargs)


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")


@pytest.mark.slow
async def test_engine_server_keeps_serving_while_50_connections_stall(tiny_chat, uncached_engine):
    """``rollflow serve``'s server: 50 connections stalled in their line, headers or body; a client is
    served meanwhile, and every stalled connection is closed (with a 408) once the timeout passes."""
    from rollflow.inference.engine.server import EngineServer

    # Long enough that the client is surely served before any stall ends, on a loaded machine too.
    limits = HttpLimits(header_timeout_s=5.0, body_timeout_s=5.0)
    server = EngineServer(uncached_engine, tiny_chat.tokenizer, served_model_name="tiny", http_limits=limits)
    url = await server.start()
    port = int(url.rsplit(":", 1)[1])
    stalls = [
        b"",
        b"POST /inference/v1/gen",
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\n",
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{",
    ]
    try:
        connections = []
        for index in range(50):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(stalls[index % len(stalls)])
            connections.append((reader, writer))
        started = time.perf_counter()
        async with aiohttp.ClientSession() as client:
            body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
            async with client.post(f"{url}/inference/v1/generate", json=body) as response:
                assert response.status == 200
        assert time.perf_counter() - started < limits.header_timeout_s  # served before any stall ended
        replies = await asyncio.gather(
            *(_read_reply(reader, within_s=READ_WITHIN_S) for reader, _ in connections)
        )
        assert all(_status_and_json(reply)[0] == 408 for reply, _ in replies)
        assert max(waited for _, waited in replies) < limits.header_timeout_s + LATE_S
        for _, writer in connections:
            writer.close()
    finally:
        await server._runner.cleanup()  # the module's engine outlives the test


# ------------------------------------------------------------------ configuration and command line


@pytest.mark.parametrize(
    "override",
    [
        "inference.http_header_timeout_s=0",
        "inference.http_body_timeout_s=-1",
        "inference.http_max_connections=0",
        "inference.http_max_connections=1.5",
    ],
)
def test_bad_http_limit_keys_name_the_key(override: str):
    from rollflow.config import load_config
    from rollflow.errors import ConfigError

    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=f"invalid value for '{key}'"):
        load_config([], [override])


def test_http_limit_keys_reach_the_servers_and_router_rollflow_starts(tmp_path):
    from rollflow.cli import _parser
    from rollflow.config import load_config
    from rollflow.launch.router_process import RouterProcess
    from rollflow.launch.server_group import build_torch_server_command

    config = load_config(
        [],
        [
            "inference.http_header_timeout_s=2.5",
            "inference.http_body_timeout_s=7",
            "inference.http_max_connections=99",
        ],
    )
    limits = config.inference.http_limits()
    assert limits == HttpLimits(header_timeout_s=2.5, body_timeout_s=7.0, max_connections=99)
    serve_argv, _ = build_torch_server_command("rollflow:tiny", http_limits=limits)
    router_argv, _ = RouterProcess(["http://127.0.0.1:1"], tmp_path, http_limits=limits)._command()[:2]
    for argv in (serve_argv, router_argv):
        # The flags parse back, through the real parser, into the same limits.
        command = argv[argv.index("rollflow") + 1 :]
        if command[0] == "serve":
            command = [*command, "--model", "rollflow:tiny"]
        assert limits_from_flags(_parser().parse_args(command)) == limits


@pytest.mark.parametrize(
    "flag", ["--http-header-timeout-s=0", "--http-body-timeout-s=nan", "--http-max-connections=0"]
)
def test_bad_http_limit_flags_exit_2_naming_the_flag(flag: str):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "rollflow", "router", "--server", "http://127.0.0.1:1", flag]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert flag.split("=", 1)[0] in result.stderr


@pytest.mark.slow
async def test_checkpoint_weight_server_drops_a_stalled_client(monkeypatch):
    """The trainer's HTTP endpoint of ``weight_sync.strategy = "checkpoint"``: a silent client is dropped."""
    from rollflow.weights import StaticWeights, checkpoint
    from rollflow.weights.trainer import checkpoint as trainer_checkpoint
    from rollflow.weights.trainer.sessions import get_session

    class Client:
        async def init_weight_transfer(self, init_info: dict) -> None:
            pass

    monkeypatch.setattr(trainer_checkpoint._Handler, "timeout", TIMEOUT_S)
    sender = checkpoint.CheckpointStrategy().create_sender({"backend": "checkpoint", "timeout_s": 10})
    await sender.setup(Client(), StaticWeights(list))
    try:
        # The endpoint is served by trainer rank 0's session of this connection (here: this process).
        host, port = get_session(sender.transfer_id, 0)._server.server_address[:2]
        connecting = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /x HTTP/1.1\r\n")  # and nothing more
        _, waited = await _read_reply(reader, within_s=READ_WITHIN_S, since=connecting)
        assert TIMEOUT_S * 0.8 <= waited < TIMEOUT_S + LATE_S
        writer.close()
    finally:
        sender.close()


@pytest.mark.parametrize("listener", ["router", "tito_proxy"])
async def test_router_and_tito_proxy_close_stalled_connections(listener: str, tiny_chat):
    from rollflow.inference.router import InferenceRouter
    from rollflow.tito import TITOProxy

    limits = HttpLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    if listener == "router":
        server = InferenceRouter([], health_check_interval_s=60, http_limits=limits)
    else:
        client = ScriptedClient(tiny_chat.tokenizer)
        server = TITOProxy(
            client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, http_limits=limits
        )
    async with server:
        if listener == "router":
            port, path = int(server.url.rsplit(":", 1)[1]), "/v1/completions"
        else:
            session = await server.open_session()
            port = server.port
            path = session.base_url.split(str(port), 1)[1] + "/chat/completions"
        # A handler that reads its body: the stall is in the body, not answered by a 404 first.
        stalls = [b"GET /hea", f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{{".encode()]
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in stalls]
        for (_, writer), payload in zip(connections, stalls, strict=True):
            writer.write(payload)
        for reader, writer in connections:
            reply, waited = await _read_reply(reader, within_s=READ_WITHIN_S)
            assert _status_and_json(reply)[0] == 408
            assert waited < TIMEOUT_S + LATE_S
            writer.close()
