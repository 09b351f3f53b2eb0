"""The step pipeline (``orchestrator/pipeline.py``): every step records each stage's waits and each channel's
depth; sync never overlaps generation with training while fully_async does; a failing barrier stage ends
the run with its own error; ``rollflow plot`` draws the pipeline figure."""

from __future__ import annotations

import asyncio
import json
import math

import anyio
import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import WeightSyncTimeoutError
from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.engine.engine import TorchEngine
from rollflow.metrics import (
    PIPELINE_DEPTH,
    PIPELINE_DEPTH_MAX,
    PIPELINE_OVERLAP,
    PIPELINE_STAGES,
    PIPELINE_WAIT_INPUT,
    PIPELINE_WAIT_OUTPUT,
)
from rollflow.orchestrator.pipeline import PipelineMeter

pytestmark = pytest.mark.local_only(reason="the stand-in client wraps an in-process engine")

PROMPTS_PER_STEP = 2
MAX_INFLIGHT = 4
#: Channel -> capacity (the generation channels hold max_inflight messages, the stage channels one).
CHANNELS = {"prompts": MAX_INFLIGHT, "groups": MAX_INFLIGHT, "batches": 1, "trained": 1, "published": 1}


class DelayedClient:
    """The real in-process engine, each generate call first sleeping ``delay_s``: a group takes at least
    that long, so whether generation runs during a step is decided by the schedule, not by how fast the
    machine is."""

    def __init__(self, inner: LocalInferenceClient, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    async def generate(self, request):
        await anyio.sleep(self.delay_s)
        return await self.inner.generate(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_config(root, mode: str, *overrides: str):
    return load_config(
        [],
        [
            f"output_dir='{root}'",
            f"name={mode}",
            "data.task='digit'",
            f"orchestrator.mode='{mode}'",
            "orchestrator.max_staleness=1",
            f"orchestrator.prompts_per_step={PROMPTS_PER_STEP}",
            f"orchestrator.max_inflight={MAX_INFLIGHT}",
            "orchestrator.steps=3",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def runs(engine, tmp_path_factory):
    """One 3-step run per mode on the same engine and workload: mode -> (run directory, step metrics)."""
    root = tmp_path_factory.mktemp("pipeline")

    async def train(mode: str):
        config = run_config(root, mode)
        client = DelayedClient(LocalInferenceClient([engine]), delay_s=0.2)
        async with Orchestrator(config, inference_client=client) as orchestrator:
            return config.run_dir, await orchestrator.run()

    mp = pytest.MonkeyPatch()
    mp.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    try:
        return {mode: asyncio.run(train(mode)) for mode in ("sync", "fully_async")}
    finally:
        mp.undo()


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_every_step_records_stage_waits_and_channel_depths(runs, mode):
    run_dir, metrics = runs[mode]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    recorded = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in recorded] == [1, 2, 3]
    for prefix in (PIPELINE_WAIT_INPUT, PIPELINE_WAIT_OUTPUT):
        for stage in PIPELINE_STAGES:
            waits = [step[prefix + stage] for step in recorded]
            assert all(math.isfinite(s) and s >= 0.0 for s in waits), (prefix + stage, waits)
            # Waits are counted once, in the step they ended in: all of them fit in the run (generation's
            # figure is per worker); the margin is the time between the run's clock and the meter's.
            assert sum(waits) <= recorded[-1]["elapsed_s"] + 0.5, (prefix + stage, waits)
    for step in recorded:
        for name, capacity in CHANNELS.items():
            depth, deepest = step[PIPELINE_DEPTH + name], step[PIPELINE_DEPTH_MAX + name]
            assert 0 <= depth <= deepest <= capacity, (name, depth, deepest)
        assert 0.0 <= step[PIPELINE_OVERLAP] <= 1.0


def test_sync_never_overlaps_and_fully_async_does(runs):
    """Sync: no group generates while a step trains and updates weights (overlap exactly 0), each batch is
    waited for, and the group channel never holds more than a step's groups. Fully async (staleness 1): the
    prompts of step 3, admitted when step 1 is published, take at least the client's delay, so they are
    still generating while step 2 (whose groups were generated during step 1) trains."""
    _, sync = runs["sync"]
    _, fully_async = runs["fully_async"]
    for step in sync:
        assert step[PIPELINE_OVERLAP] == pytest.approx(0.0, abs=1e-9)
        assert step[PIPELINE_WAIT_INPUT + "batcher"] > 0.0, "a sync batch is generated after it is asked for"
        assert step[PIPELINE_DEPTH_MAX + "groups"] <= PROMPTS_PER_STEP
    assert fully_async[1][PIPELINE_OVERLAP] > 0.0
    assert fully_async[1][PIPELINE_OVERLAP] > sync[1][PIPELINE_OVERLAP]


async def test_a_failing_barrier_stage_ends_the_run_with_its_error(engine, tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    config = run_config(tmp_path, "fully_async")
    async with Orchestrator(config, inference_client=LocalInferenceClient([engine])) as orchestrator:
        update = orchestrator.barrier.update

        async def failing_update(trainer, policy_version, pause_mode):
            if policy_version == 2:
                raise WeightSyncTimeoutError("weight update to policy version 2: planted failure")
            return await update(trainer, policy_version, pause_mode)

        monkeypatch.setattr(orchestrator.barrier, "update", failing_update)
        with anyio.fail_after(60), pytest.raises(WeightSyncTimeoutError, match="planted failure"):
            await orchestrator.run()
        assert orchestrator.state.step == 1
        assert orchestrator.state.policy_version == 1
        assert orchestrator._generation is None, "generation was stopped with the run"


async def test_meter_times_waits_and_depths():
    """The meter counts a wait only when a stage blocked: on input while its channel was empty, on output
    while it was full; the depth at most is kept until the step's metrics are taken."""
    meter = PipelineMeter()
    meter.stage("producer")
    meter.stage("consumer")
    send, receive = meter.channel("items", int, 1)
    await meter.send("producer", "items", send, 1)  # room: no wait

    async def consume():
        assert await meter.receive("consumer", receive) == 1  # a message is waiting: no wait

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await meter.send("producer", "items", send, 2)  # full until the consumer takes 1
    metrics = meter.take()
    assert metrics[PIPELINE_WAIT_INPUT + "consumer"] == 0.0
    assert metrics[PIPELINE_WAIT_OUTPUT + "producer"] > 0.0
    assert metrics[PIPELINE_DEPTH + "items"] == 1.0 and metrics[PIPELINE_DEPTH_MAX + "items"] == 1.0
    assert await meter.receive("consumer", receive) == 2
    again = meter.take()
    assert again[PIPELINE_WAIT_OUTPUT + "producer"] == 0.0
    assert again[PIPELINE_DEPTH + "items"] == 0.0 and again[PIPELINE_DEPTH_MAX + "items"] == 1.0


@pytest.mark.slow
def test_plot_draws_the_pipeline_figure(runs, tmp_path):
    from rollflow.plots import plot_runs

    from .helpers.images import read_png

    written = plot_runs([runs["sync"][0], runs["fully_async"][0]], tmp_path / "plots")
    assert tmp_path / "plots" / "pipeline.png" in written
    width, height = read_png(tmp_path / "plots" / "pipeline.png")
    assert height > width / 2, "a row of panels per run and one for the overlap"
