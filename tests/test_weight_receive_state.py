"""The engine server's weight-receive state machine, without HTTP: init, start, update, finish, and what a
trainer that fails or reconnects mid-round does to it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from rollflow.errors import WeightReceiveError, WeightTransferError
from rollflow.weights.server.state import WeightReceiveState

TIMEOUT_S = 5.0


class FakeReceiver:
    """Returns one named "tensor" per update (the update's ``tag``); blocks while ``gate`` is clear, and
    raises when the update asks it to ``fail``."""

    def __init__(self, init_info: dict[str, Any], worker_rank: int):
        if init_info.get("bad"):
            raise ValueError("init_info.bad is set")
        self.init_info = init_info
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.closed = threading.Event()

    def receive(self, update_info: dict[str, Any]) -> list[tuple[str, Any]]:
        self.entered.set()
        assert self.gate.wait(TIMEOUT_S)
        if update_info.get("fail"):
            raise WeightTransferError("the trainer left the group")
        return [("w", update_info.get("tag"))]

    def close(self) -> None:
        self.closed.set()


class Factory:
    def __init__(self) -> None:
        self.built: list[FakeReceiver] = []

    def __call__(self, init_info: dict[str, Any], worker_rank: int) -> FakeReceiver:
        receiver = FakeReceiver(init_info, worker_rank)
        self.built.append(receiver)
        return receiver


class Engine:
    """What the server does with received tensors: load them, labelled with their version."""

    def __init__(self) -> None:
        self.loaded: list[tuple[Any, int]] = []
        self.labels: list[int] = []

    async def load(self, tensors: Any, version: int) -> None:
        self.loaded.append((tensors, version))

    async def label(self, version: int) -> None:
        self.labels.append(version)


@pytest.fixture
def factory() -> Factory:
    return Factory()


@pytest.fixture
def state(factory: Factory) -> WeightReceiveState:
    return WeightReceiveState(factory)


async def refused(call, kind: str, match: str) -> WeightReceiveError:
    with pytest.raises(WeightReceiveError, match=match) as raised:
        await call
    assert raised.value.kind == kind
    return raised.value


async def test_one_round_loads_the_version_and_raises_the_floor(state, factory):
    engine = Engine()
    await state.init({"rank_offset": 1}, TIMEOUT_S)
    assert state.has_receiver and state.epoch == 1 and state.version_floor is None
    await state.start(loaded_version=0)
    assert state.update_active
    assert await state.update({"tag": "a", "policy_version": 3}, engine.load) == 3
    await state.finish(3, engine.label)
    assert engine.loaded == [([("w", "a")], 3)] and engine.labels == [3]
    assert not state.update_active and state.version_floor == 3
    # Without a policy_version of its own an update loads the one after what the engine holds.
    await state.start(loaded_version=3)
    assert await state.update({"tag": "b"}, engine.load) == 4
    await state.finish(None, engine.label)
    assert engine.labels == [3] and state.version_floor == 4


async def test_calls_out_of_order_are_refused(state):
    engine = Engine()
    await refused(state.update({}, engine.load), "invalid", "start_weight_update must be called before")
    await refused(state.finish(1, engine.label), "invalid", "start_weight_update must be called before")
    await state.start(0)
    await refused(state.update({}, engine.load), "invalid", "init_weight_transfer_engine must be called")
    await state.init({}, TIMEOUT_S)
    await state.start(0)
    await refused(state.start(0), "invalid", "start_weight_update was already called")
    error = await refused(
        state.update({"policy_version": "7"}, engine.load), "invalid", "policy_version must be an integer"
    )
    assert error.param == "update_info"
    assert engine.loaded == []


async def test_a_stale_version_is_refused_until_a_new_init(state):
    engine = Engine()
    await state.init({}, TIMEOUT_S)
    await state.start(0)
    await state.update({"tag": "new", "policy_version": 5}, engine.load)
    await state.finish(5, engine.label)
    await state.start(5)
    # Received first (a broadcast needs every receiver), then refused: nothing loaded.
    error = await refused(
        state.update({"tag": "old", "policy_version": 4}, engine.load),
        "conflict",
        "older than policy version 5",
    )
    assert error.param == "update_info"
    error = await refused(state.finish(4, engine.label), "conflict", "weight_version = 4 is older")
    assert error.param == "weight_version"
    assert [version for _, version in engine.loaded] == [5] and engine.labels == [5]
    # A new init (a resumed run) starts a new session: its versions may begin lower.
    await state.init({}, TIMEOUT_S)
    assert state.version_floor is None
    await state.start(5)
    assert await state.update({"tag": "resumed", "policy_version": 2}, engine.load) == 2


async def test_a_failed_receive_ends_the_round(state, factory):
    engine = Engine()
    await state.init({}, TIMEOUT_S)
    await state.start(0)
    await refused(
        state.update({"fail": True}, engine.load), "failed", "weight transfer failed: .*left the group"
    )
    assert not state.update_active and engine.loaded == []
    await state.start(0)  # the trainer starts a new round
    assert await state.update({"tag": "retry", "policy_version": 1}, engine.load) == 1


async def test_a_refused_load_can_end_the_round(state):
    async def refuse(tensors: Any, version: int) -> None:
        state.end_round()
        raise RuntimeError("non-finite weights")

    await state.init({}, TIMEOUT_S)
    await state.start(0)
    with pytest.raises(RuntimeError, match="non-finite"):
        await state.update({"policy_version": 1}, refuse)
    assert not state.update_active and state.version_floor is None


async def test_a_second_init_mid_update_supersedes_the_blocked_receive(state, factory):
    engine = Engine()
    await state.init({"session": 1}, TIMEOUT_S)
    first = factory.built[0]
    first.gate.clear()  # the trainer died mid-broadcast: this receive blocks
    await state.start(0)
    update = asyncio.create_task(state.update({"tag": "stale", "policy_version": 1}, engine.load))
    assert await asyncio.to_thread(first.entered.wait, TIMEOUT_S)
    # The trainer reconnects: init is not held behind the blocked receive, and abandons its round.
    await asyncio.wait_for(state.init({"session": 2}, TIMEOUT_S), TIMEOUT_S)
    assert state.epoch == 2 and not state.update_active and not first.closed.is_set()
    await state.start(0)
    assert await state.update({"tag": "fresh", "policy_version": 1}, engine.load) == 1
    first.gate.set()  # the old receive returns late: discarded, and its receiver closed
    await refused(update, "conflict", "re-initialized while this update was receiving")
    assert first.closed.is_set()
    assert engine.loaded == [([("w", "fresh")], 1)]


async def test_init_closes_the_previous_receiver_and_maps_bad_payloads(state, factory):
    await state.init({}, TIMEOUT_S)
    await state.init({}, TIMEOUT_S)
    assert factory.built[0].closed.is_set() and not factory.built[1].closed.is_set()
    error = await refused(state.init({"bad": True}, TIMEOUT_S), "invalid", "invalid init_info: init_info.bad")
    assert error.param == "init_info"
    await state.shutdown()
    assert not state.has_receiver and factory.built[1].closed.is_set()


async def test_vllm_list_form_picks_this_workers_entry(state):
    engine = Engine()
    await state.init({"rank_offset": 2}, TIMEOUT_S)
    await state.start(0)
    entries = [{"tag": "worker 0"}, {"tag": "worker 1"}]
    await state.update(entries, engine.load)
    assert engine.loaded == [([("w", "worker 1")], 1)]
    await state.finish(None, engine.label)
    await state.start(1)
    await refused(state.update(entries[:1], engine.load), "invalid", "update_info is a list of 1")
