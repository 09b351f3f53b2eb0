"""Colocation on a CUDA GPU (``nox -s gpu_tests``): the torch engine's sleep gives its GPU memory back (level 1:
KV cache freed, weights offloaded to CPU memory; level 2: weights freed too) and wake-up restores it; and a
colocated run whose server shares the trainer's GPU sleeps and wakes around each step, its weights pushed by
CUDA IPC."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from rollflow.config import INFERENCE_MODE_ENV, load_config
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 2**20


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_frees_cuda_memory_and_wake_up_restores_it(level):
    # What earlier tests of this process left cached (blocks shared with tensors still alive, which
    # empty_cache cannot return) is not this test's: the bar below is on top of it.
    gc.collect()
    torch.cuda.empty_cache()
    cached_before = torch.cuda.memory_reserved() - allocated()
    model_dir = resolve_model_path("rollflow:tiny")
    cpu_model = load_causal_lm(model_dir)
    weights = {name: tensor.clone() for name, tensor in cpu_model.state_dict().items()}
    # A KV cache of some size, so its release is plain in the allocator's figures.
    engine = TorchEngine(copy.deepcopy(cpu_model).to("cuda"), max_batch_size=32, max_model_len=2048)
    server = EngineServer(
        engine,
        load_tokenizer(model_dir),
        served_model_name="tiny",
        receiver_factory=lambda init_info, rank: StateDictReceiver(weights),
    )
    await server.start()
    try:
        status, before = await generate(server)
        assert status == 200
        kv_bytes = engine.runner.kv_cache_bytes
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        awake = allocated()
        assert (await call(server, "POST", "/init_weight_transfer_engine", {"init_info": {}}))[0] == 200

        assert (await call(server, "POST", f"/sleep?level={level}&mode=wait"))[0] == 200
        asleep = allocated()
        # Both levels give the KV cache and the weights' GPU memory back (level 1 keeps a CPU copy).
        assert awake - asleep >= kv_bytes + weight_bytes, (awake, asleep, kv_bytes, weight_bytes)
        # Returned to the driver, not only cached.
        assert torch.cuda.memory_reserved() - asleep <= cached_before + 64 * MiB
        assert (await generate(server))[0] == 503

        await call(server, "POST", "/wake_up?tags=weights")
        assert allocated() - asleep >= weight_bytes
        assert allocated() < awake - kv_bytes // 2  # the KV cache still sleeps while the weights are pushed
        if level == 2:
            assert all(not p.any() for p in engine.model.parameters())
        assert (await call(server, "POST", "/start_weight_update"))[0] == 200
        assert (await call(server, "POST", "/update_weights", {"update_info": {"policy_version": 1}}))[
            0
        ] == 200
        assert (await call(server, "POST", "/finish_weight_update"))[0] == 200
        await call(server, "POST", "/wake_up?tags=kv_cache")
        assert abs(allocated() - awake) <= 16 * MiB
        status, after = await generate(server)
        assert status == 200
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    finally:
        await server.close()


async def test_colocated_run_on_the_trainers_gpu_pushes_by_cuda_ipc(tmp_path, monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)
    steps = 3
    config = load_config(
        [QUICKSTART],
        [
            f"output_dir='{tmp_path}'",
            "inference.mode='http'",
            "inference.num_servers=1",
            "inference.colocate=true",
            "inference.sleep_level=2",
            "inference.device='cuda'",
            "trainer.device='cuda'",
            "trainer.dtype='float32'",
            f"orchestrator.steps={steps}",
            "checkpoint.every=0",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        from rollflow.weights.cuda_ipc import CudaIpcStrategy

        assert isinstance(orchestrator.barrier.transfer.strategy, CudaIpcStrategy)  # colocated on a GPU: IPC
        metrics = await orchestrator.run()
        (entries,) = await control_logs(list(orchestrator.client.server_urls))
    cycles = step_cycles(entries)
    assert len(cycles) == steps
    for step, cycle in enumerate(cycles, start=1):
        check_cycle(cycle, level=2, version=step)
    # The engine samples with exactly the weights the trainer pushed (float32 on both sides).
    assert max(m["logprob_mismatch"] for m in metrics) < 1e-3
