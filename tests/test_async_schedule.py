"""Async schedules under random generation latencies and random barrier timings: the staleness bound holds
per sample, no prompt is trained twice or lost, and in keep mode per-token versions never decrease."""

from __future__ import annotations

import json
import random

import anyio
import pytest

from rollflow import Orchestrator, load_config
from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.engine.engine import TorchEngine


class JitteryClient:
    """The real in-process engine, with random delays before each generate and each pause, so groups finish
    out of order and barriers land at random points of generation."""

    def __init__(self, inner: LocalInferenceClient, seed: int):
        self.inner = inner
        self.rng = random.Random(seed)

    async def generate(self, request):
        await anyio.sleep(self.rng.expovariate(1 / 0.01))  # long-tailed latencies
        return await self.inner.generate(request)

    async def pause(self, mode="abort"):
        await anyio.sleep(self.rng.uniform(0, 0.02))
        await self.inner.pause(mode)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=16, max_model_len=128)


@pytest.mark.parametrize(
    ("mode", "barrier", "max_staleness", "seed"),
    [
        ("fully_async", "keep", 1, 0),
        ("fully_async", "keep", 2, 1),
        ("fully_async", "abort", 1, 2),
        ("fully_async", "wait", 0, 3),
        ("one_step", "abort", 0, 4),
        ("sync", "keep", 0, 5),
    ],
)
async def test_staleness_bound_and_exactly_once(
    tmp_path, monkeypatch, engine, mode, barrier, max_staleness, seed
):
    # The stand-in client wraps an in-process engine: weights move in process whatever mode the suite runs in.
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    config = load_config(
        [],
        [
            f"output_dir='{tmp_path}'",
            "name=prop",
            "data.task='digit'",
            f"orchestrator.mode='{mode}'",
            f"orchestrator.barrier='{barrier}'",
            f"orchestrator.max_staleness={max_staleness}",
            "orchestrator.prompts_per_step=3",
            "orchestrator.max_inflight=5",
            "orchestrator.steps=8",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=6",
            f"seed={seed}",
        ],
    )
    bound = {"sync": 0, "one_step": 1}.get(mode, max_staleness)
    client = JitteryClient(LocalInferenceClient([engine]), seed)
    trained: list[tuple[int, int, list[int]]] = []  # (step, prompt index, token versions)

    async with Orchestrator(config, inference_client=client) as orchestrator:
        train_step = orchestrator.trainer.train_step
        weights_version = orchestrator.state.policy_version

        def recording_train_step(batch, **kwargs):
            for sample in batch.samples:
                trained.append((batch.step, sample.prompt_index, sample.policy_versions))
                # Per sample, against the weights being trained: never beyond the bound.
                assert weights_version_now() - sample.min_policy_version <= bound
            return train_step(batch, **kwargs)

        def weights_version_now():
            return orchestrator.state.policy_version

        orchestrator.trainer.train_step = recording_train_step
        metrics = await orchestrator.run(steps=5)
        metrics += await orchestrator.run()  # a second call regenerates what the first left in flight
        assert weights_version == 0

    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m["staleness_max"] <= bound for m in metrics)
    prompts = sorted({prompt for _, prompt, _ in trained})
    assert len(prompts) == 8 * 3
    per_prompt = [sum(1 for _, p, _ in trained if p == prompt) for prompt in prompts]
    assert per_prompt == [2] * len(prompts), "each prompt's group trained exactly once"
    # Out-of-order training leaves gaps only for prompts still owed (in flight or dropped for staleness
    # when the run stopped): the checkpointed data position and trained-ahead list say exactly which.
    state = orchestrator.state
    assert set(prompts) == set(range(state.data_position)) | set(state.trained_ahead)
    gaps = set(range(max(prompts))) - set(prompts)
    assert len(gaps) <= config.orchestrator.max_inflight
    if mode == "sync":
        assert prompts == list(range(8 * 3))
    for _, _, versions in trained:
        assert versions == sorted(versions), "per-token versions never decrease within a trajectory"
    rollouts = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_index"] for r in rollouts) == prompts
