"""An ``Authorization`` header that is not UTF-8 is a wrong token (issue 30, item 14): 401 with the JSON error
body and nothing logged as an error, on ``rollflow serve`` and the router with an API key and on the TITO
proxy's admin API. Before, each such request was a 500 with a traceback in the log.

Real listeners on loopback; the requests go over raw sockets, since HTTP clients refuse to send such bytes.
"""

from __future__ import annotations

import asyncio
import copy
import json

from structlog.testing import capture_logs

from rollflow.http.auth import bearer_token_matches
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.router import InferenceRouter
from rollflow.models.loading import load_causal_lm, load_tokenizer
from rollflow.tito.proxy import TITOProxy
from rollflow.tito.testing import load_tiny_chat

KEY = "s3cret-key"
BAD_HEADERS = [b"Bearer \xff\xfe", b"\xff\xfe\xfd", b"Bearer s3cret-key\xc3", b"bEaReR \x80" + KEY.encode()]
COMPLETION = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1}).encode()


async def send(
    port: int, method: str, path: str, authorization: bytes, body: bytes = b""
) -> tuple[int, dict]:
    """One request over a new connection, with ``authorization`` as the header's raw bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"%s %s HTTP/1.1\r\nHost: test\r\nAuthorization: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (method.encode(), path.encode(), authorization, len(body), body)
        )
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():  # not expected for errors; decode to be safe
        chunks, rest = [], payload
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2 :]
        payload = b"".join(chunks)
    return int(head.split()[1]), json.loads(payload) if payload else {}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def assert_unauthorized(status: int, body: dict, where: str) -> None:
    assert status == 401, (where, status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert "bearer token" in error["message"], where


def assert_no_error_logged(logs: list[dict]) -> None:
    bad = [e for e in logs if e.get("log_level") in ("error", "critical") or e.get("exc_info")]
    assert bad == [], bad


def test_the_shared_check_takes_bytes_and_surrogate_escaped_text():
    assert bearer_token_matches("Bearer " + KEY, KEY)
    assert bearer_token_matches(b"bearer " + KEY.encode(), KEY)
    assert not bearer_token_matches("Bearer \udcff\udcfe", KEY)  # how aiohttp decodes b"\xff\xfe"
    assert not bearer_token_matches(None, KEY) and not bearer_token_matches("", KEY)
    assert not bearer_token_matches("Basic " + KEY, KEY) and not bearer_token_matches(KEY, KEY)


async def test_non_utf8_authorization_is_401_on_serve_and_router(tiny_model_dir):
    engine = TorchEngine(copy.deepcopy(load_causal_lm(tiny_model_dir)), max_batch_size=2, max_model_len=64)
    server = EngineServer(engine, load_tokenizer(tiny_model_dir), served_model_name="tiny", api_key=KEY)
    await server.start()
    router = InferenceRouter([server.url], health_check_interval_s=0.5, api_key=KEY)
    await router.start()
    try:
        with capture_logs() as logs:
            for name, url in (("serve", server.url), ("router", router.url)):
                port = port_of(url)
                for header in BAD_HEADERS:
                    for method, path, body in (
                        ("POST", "/v1/completions", COMPLETION),
                        ("GET", "/v1/models", b""),
                        ("POST", "/pause", b""),
                    ):
                        status, answer = await send(port, method, path, header, body)
                        assert_unauthorized(status, answer, f"{name} {path} {header!r}")
        assert_no_error_logged(logs)
        # The right key still passes.
        status, answer = await send(
            port_of(server.url), "POST", "/v1/completions", f"Bearer {KEY}".encode(), COMPLETION
        )
        assert status == 200, answer
    finally:
        await router.stop()
        await server.close()


async def test_non_utf8_authorization_is_401_on_the_proxy_admin_api(tiny_model_dir):
    chat = load_tiny_chat(tiny_model_dir)
    proxy = TITOProxy(object(), chat.renderer, chat.tokenizer, model_name="tiny", admin_token=KEY)
    await proxy.start()
    try:
        with capture_logs() as logs:
            for header in BAD_HEADERS:
                for method, path in (
                    ("POST", "/sessions"),
                    ("GET", "/sessions/s-1/trace"),
                    ("POST", "/sessions/s-1/close"),
                ):
                    status, answer = await send(proxy.port, method, path, header, b"{}")
                    assert_unauthorized(status, answer, f"proxy {path} {header!r}")
        assert_no_error_logged(logs)
        status, answer = await send(proxy.port, "POST", "/sessions", f"Bearer {KEY}".encode(), b"{}")
        assert status == 200 and answer["session_id"], answer
    finally:
        await proxy.close()
