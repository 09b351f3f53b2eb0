"""``/init_weight_transfer_engine`` honours ``init_info.timeout_s`` end to end (issue 30, item 6).

A trainer rendezvous that accepts the TCP connection and never answers used to hold the init for good (still
blocked after 240 s with a 5 s timeout), and with it the server's weights lock: a second init and
``/start_weight_update`` blocked too. Here the peer is a real socket on loopback that accepts and stays silent,
and the server is a real ``EngineServer`` with its real receiver factory. Waits are conditions with generous
deadlines; the only timing the tests rely on is that the server answers at all.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import threading

import aiohttp
import pytest

from rollflow.errors import InvalidTransferInfoError, WeightTransferTimeoutError
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.models.loading import load_causal_lm, load_tokenizer
from rollflow.weights.server.receiver import create_receiver, init_timeout_s

TIMEOUT_S = 0.5
# Far beyond TIMEOUT_S: only a server that ignores the timeout gets near it.
DEADLINE_S = 60.0


@pytest.fixture
def silent_peer():
    """A TCP port that accepts connections and never sends a byte; yields (port, accepted connections)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1], accepted
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()  # the receivers' threads blocked on them return now
    listener.close()


def gloo_init_info(port: int) -> dict:
    return {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": port,
        "world_size": 2,
        "rank_offset": 1,
        "timeout_s": TIMEOUT_S,
    }


def test_create_receiver_gives_up_after_timeout_s(silent_peer):
    port, accepted = silent_peer
    outcome: list[BaseException] = []

    def build() -> None:
        try:
            create_receiver(gloo_init_info(port), 0)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "create_receiver ignored init_info.timeout_s"
    [error] = outcome
    assert isinstance(error, WeightTransferTimeoutError)
    assert f"init_info.timeout_s = {TIMEOUT_S:g} s" in str(error) and f"127.0.0.1:{port}" in str(error)
    assert accepted  # it did reach the peer


@pytest.mark.parametrize("value", [0, -1, "5", float("nan"), float("inf"), True])
def test_a_bad_timeout_s_is_named(value):
    with pytest.raises(InvalidTransferInfoError, match=r"init_info.timeout_s must be a positive number"):
        init_timeout_s({"backend": "checkpoint", "timeout_s": value})
    assert init_timeout_s({"backend": "checkpoint"}) == 300.0


class Hanging:
    """A receiver factory that blocks until released, then returns a receiver that records its close."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed = threading.Event()
        self.calls = 0

    def __call__(self, init_info, worker_rank):
        self.calls += 1
        if init_info.get("hang"):
            self.release.wait()
        factory = self

        class Receiver:
            def receive(self, update_info):
                return []

            def close(self):
                factory.closed.set()

        return Receiver()


async def start_server(tiny_model_dir, receiver_factory=None) -> EngineServer:
    engine = TorchEngine(copy.deepcopy(load_causal_lm(tiny_model_dir)), max_batch_size=1, max_model_len=64)
    server = EngineServer(
        engine, load_tokenizer(tiny_model_dir), served_model_name="tiny", receiver_factory=receiver_factory
    )
    await server.start()
    return server


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with asyncio.timeout(DEADLINE_S), http.post(url, json=body) as response:
        return response.status, await response.json()


async def test_a_silent_rendezvous_ends_the_init_within_timeout_s_and_frees_the_server(
    tiny_model_dir, silent_peer
):
    port, _ = silent_peer
    server = await start_server(tiny_model_dir)
    try:
        async with aiohttp.ClientSession() as http:
            init = f"{server.url}/init_weight_transfer_engine"
            # Two inits at once: neither waits behind the other for good.
            answers = await asyncio.gather(
                post(http, init, {"init_info": gloo_init_info(port)}),
                post(http, init, {"init_info": gloo_init_info(port)}),
            )
            for status, body in answers:
                assert status == 502, body
                assert f"init_info.timeout_s = {TIMEOUT_S:g} s" in body["error"]["message"]
                assert body["error"]["param"] == "init_info"
            # The weights lock is free: the update lifecycle answers.
            status, body = await post(http, f"{server.url}/start_weight_update", {})
            assert status == 200, body
            status, body = await post(http, f"{server.url}/finish_weight_update", {})
            assert status == 200, body
            status, body = await post(
                http, init, {"init_info": {"backend": "checkpoint", "timeout_s": "soon"}}
            )
            assert status == 400 and "init_info.timeout_s" in body["error"]["message"]
    finally:
        await server.close()


async def test_a_factory_that_hangs_is_bounded_and_its_late_receiver_closed(tiny_model_dir):
    factory = Hanging()
    server = await start_server(tiny_model_dir, factory)
    try:
        async with aiohttp.ClientSession() as http:
            init = f"{server.url}/init_weight_transfer_engine"
            status, body = await post(http, init, {"init_info": {"hang": True, "timeout_s": TIMEOUT_S}})
            assert status == 502 and "the receiver was not ready" in body["error"]["message"], body
            # A new init works at once, and is the one in force.
            status, body = await post(http, init, {"init_info": {"timeout_s": TIMEOUT_S}})
            assert status == 200, body
            factory.release.set()  # the abandoned construction returns: its receiver is closed, not used
            assert await asyncio.to_thread(factory.closed.wait, DEADLINE_S)
            assert server.weights.has_receiver
    finally:
        factory.release.set()
        await server.close()
