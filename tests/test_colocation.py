"""Colocation: the torch engine server's sleep levels and two-stage wake-up (vLLM's HTTP API), and colocated
runs whose servers sleep and wake around every training step, in order, as the servers record it."""

from __future__ import annotations

import copy
import itertools

import aiohttp
import pytest
import pytest_asyncio
import torch

from rollflow.config import INFERENCE_MODE_ENV, load_config
from rollflow.errors import ConfigError
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rollflow.orchestrator import Orchestrator

from .helpers.colocation import (
    QUICKSTART,
    StateDictReceiver,
    call,
    check_cycle,
    control_logs,
    generate,
    step_cycles,
)


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)


@pytest_asyncio.fixture
async def server():
    model_dir = resolve_model_path("rollflow:tiny")
    model = load_causal_lm(model_dir)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    engine = TorchEngine(copy.deepcopy(model), max_batch_size=4, max_model_len=256)
    server = EngineServer(
        engine,
        load_tokenizer(model_dir),
        served_model_name="tiny",
        receiver_factory=lambda init_info, rank: StateDictReceiver(weights),
    )
    await server.start()
    yield server
    await server.close()


def parameter_bytes(engine: TorchEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


async def test_level_1_frees_the_kv_cache_keeps_the_weights_and_wakes_in_two_stages(server):
    engine = server.engine
    status, before = await generate(server)
    assert status == 200
    kv_bytes, weight_bytes = engine.runner.kv_cache_bytes, parameter_bytes(engine)
    assert kv_bytes > 0

    assert (await call(server, "POST", "/sleep?level=1&mode=wait"))[1] == {"status": "sleeping", "level": 1}
    assert engine.runner.kv_cache_bytes == 0
    assert parameter_bytes(engine) == weight_bytes  # on the CPU the weights stay where they are
    status, body = await generate(server)
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert "sleeping" in body["error"]["message"]

    assert (await call(server, "POST", "/wake_up?tags=weights"))[1]["status"] == "sleeping"
    assert (await call(server, "GET", "/is_sleeping"))[1] == {"is_sleeping": True}
    assert (await generate(server))[0] == 503  # the KV cache still sleeps
    assert (await call(server, "POST", "/wake_up?tags=kv_cache"))[1]["status"] == "awake"
    assert engine.runner.kv_cache_bytes == kv_bytes
    status, after = await generate(server)
    assert status == 200
    # Same weights, same seed: the same tokens and logprobs as before the sleep.
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


async def test_level_2_discards_the_weights_until_the_push_reloads_them(server):
    engine = server.engine
    _, before = await generate(server)
    await call(server, "POST", "/init_weight_transfer_engine", {"init_info": {}})
    assert (await call(server, "POST", "/sleep?level=2"))[0] == 200
    assert parameter_bytes(engine) == 0 and engine.runner.kv_cache_bytes == 0

    # A push while the weights sleep has nowhere to go: 409 naming the fix.
    assert (await call(server, "POST", "/start_weight_update"))[0] == 200
    status, body = await call(server, "POST", "/update_weights", {"update_info": {"policy_version": 1}})
    assert status == 409 and "/wake_up?tags=weights" in body["error"]["message"]

    await call(server, "POST", "/wake_up?tags=weights")
    assert parameter_bytes(engine) > 0
    assert all(not p.any() for p in engine.model.parameters())  # back zeroed, for the push to fill
    status, body = await call(server, "POST", "/update_weights", {"update_info": {"policy_version": 1}})
    assert status == 200, body
    assert (await call(server, "POST", "/finish_weight_update"))[0] == 200
    await call(server, "POST", "/wake_up?tags=kv_cache")
    status, after = await generate(server)
    assert status == 200
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["choices"][0]["policy_versions"] == [1] * 6

    log = [entry["event"] for entry in (await call(server, "GET", "/control_log?clear=true"))[1]["entries"]]
    assert log == ["sleep", "wake_up", "update_weights", "finish_weight_update", "wake_up"]
    assert (await call(server, "GET", "/control_log"))[1] == {"entries": []}
    async with aiohttp.ClientSession() as http, http.get(server.url + "/metrics") as response:
        text = await response.text()
    assert "rollflow:sleep_calls_total" in text and "rollflow:wake_up_calls_total" in text


async def test_sleep_refuses_keep_for_levels_that_free_the_kv_cache(server):
    for level in (1, 2):
        status, body = await call(server, "POST", f"/sleep?level={level}&mode=keep")
        assert status == 400 and body["error"]["param"] == "mode" and "mode=abort" in body["error"]["message"]
    assert (await call(server, "POST", "/sleep?level=0&mode=keep"))[0] == 200
    # Level 0 only pauses scheduling: any wake-up resumes it.
    assert (await call(server, "POST", "/wake_up?tags=scheduling"))[1]["status"] == "awake"
    assert (await generate(server))[0] == 200


async def test_engine_refuses_to_sleep_over_running_requests():
    import asyncio

    from rollflow.errors import EngineError
    from rollflow.messages import GenerateRequest, SamplingParams

    engine = TorchEngine(
        load_causal_lm(resolve_model_path("rollflow:tiny")), max_batch_size=2, max_model_len=512
    )
    request = GenerateRequest([5, 6], SamplingParams(max_tokens=500, temperature=1.0), request_id="long")
    running = asyncio.create_task(engine.generate(request))
    try:
        async with asyncio.timeout(30):
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
        await engine.pause("keep")  # frozen: it still holds its KV-cache slot
        with pytest.raises(EngineError, match="cannot sleep with 1 request"):
            await engine.sleep(1)
        assert engine.sleeping_tags == frozenset()
        await engine.abort()
        await engine.sleep(2)
        assert engine.sleeping_tags == {"weights", "kv_cache"}
        with pytest.raises(EngineError, match="while the weights are asleep"):
            await engine.load_weights([("model.norm.weight", torch.ones(engine.model.config.hidden_size))], 1)
        await engine.wake_up()
        assert engine.sleeping_tags == frozenset()
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            await engine.sleep(0)
        with pytest.raises(ValueError, match="wake_up tags"):
            await engine.wake_up(["scheduling"])
    finally:
        await engine.shutdown()
    assert (await running).finish_reason.value == "abort"


def test_colocate_config_errors_name_the_keys():
    with pytest.raises(ConfigError) as info:
        load_config(
            overrides=["inference.mode='http'", "inference.colocate=true", "orchestrator.mode='fully_async'"]
        )
    assert "inference.colocate" in str(info.value) and "orchestrator.mode = 'fully_async'" in str(info.value)
    with pytest.raises(ConfigError, match="inference.colocate = true needs inference.mode = 'http'"):
        load_config(overrides=["inference.colocate=true"])
    for mode in ("sync", "one_step"):
        config = load_config(
            overrides=["inference.mode='http'", "inference.colocate=true", f"orchestrator.mode='{mode}'"]
        )
        assert config.inference.colocate and config.inference.sleep_level == 1


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "level"), [("sync", 2), ("one_step", 1)])
async def test_colocated_run_sleeps_and_wakes_around_every_step(tmp_path, mode, level):
    steps = 4
    config = load_config(
        [QUICKSTART],
        [
            f"output_dir='{tmp_path}'",
            "inference.mode='http'",
            "inference.router_port=0",
            "inference.colocate=true",
            f"inference.sleep_level={level}",
            f"orchestrator.mode='{mode}'",
            f"orchestrator.steps={steps}",
            "checkpoint.every=0",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
        urls = list(orchestrator.client.server_urls)
        logs = await control_logs(urls)
    assert len(urls) == 2 and [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["sleep_time_s"] > 0 and m["wake_time_s"] > 0 for m in metrics)
    if mode == "one_step":
        assert max(m.get("staleness_max", 0) for m in metrics) <= 1
    for entries in logs:
        cycles = step_cycles(entries)
        assert len(cycles) == steps
        for step, cycle in enumerate(cycles, start=1):
            check_cycle(cycle, level, version=step)
        # Generation ran on every server between one step's wake-up and the next step's sleep.
        if mode == "sync":
            generated = [cycle[0]["tokens_generated"] for cycle in cycles]
            assert all(later > earlier for earlier, later in itertools.pairwise(generated))


@pytest.mark.slow
async def test_a_failed_step_leaves_the_servers_awake_for_the_next_run(tmp_path, monkeypatch):
    """A training step that raises while the servers sleep: they are woken (weights pushed back at the
    current version, level 2) before the error propagates, and the next ``run`` trains on."""
    config = load_config(
        [QUICKSTART],
        [
            f"output_dir='{tmp_path}'",
            "inference.mode='http'",
            "inference.num_servers=1",
            "inference.colocate=true",
            "inference.sleep_level=2",
            "orchestrator.steps=3",
            "checkpoint.every=0",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=1)
        train = orchestrator._pack_and_train

        def failing(*args):
            raise RuntimeError("the step failed")

        monkeypatch.setattr(orchestrator, "_pack_and_train", failing)
        with pytest.raises(RuntimeError, match="the step failed"):
            await orchestrator.run(steps=1)
        (url,) = orchestrator.client.server_urls
        async with aiohttp.ClientSession() as http, http.get(f"{url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": False}
        monkeypatch.setattr(orchestrator, "_pack_and_train", train)
        metrics = await orchestrator.run()
        (entries,) = await control_logs([url])
    assert [m["step"] for m in metrics] == [2, 3]
    cycles = step_cycles(entries)
    assert len(cycles) == 4  # step 1, the failed step (woken with version 1 pushed again), steps 2 and 3
    check_cycle(cycles[1], level=2, version=1)
    for cycle, version in zip(cycles[2:], (2, 3), strict=True):
        check_cycle(cycle, level=2, version=version)
