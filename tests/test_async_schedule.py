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

from .helpers.waits import wait_until

pytestmark = pytest.mark.local_only(
    reason="stand-in clients wrap an in-process engine; weights move in process"
)


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
        metrics += await orchestrator.run()  # a second call trains on what generation went on producing
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


class SlowClient:
    """The real in-process engine, with a fixed delay before each generate; counts the calls it finished and
    those in flight."""

    def __init__(self, inner: LocalInferenceClient, delay_s: float, fail_at: int | None = None):
        self.inner = inner
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.calls = 0
        self.in_flight = 0

    async def generate(self, request):
        self.in_flight += 1
        try:
            await anyio.sleep(self.delay_s)
            if self.fail_at is not None and self.calls + 1 >= self.fail_at:
                raise RuntimeError("the engine exploded")
            output = await self.inner.generate(request)
        finally:
            self.in_flight -= 1
        self.calls += 1
        return output

    def __getattr__(self, name):
        return getattr(self.inner, name)


def loop_config(tmp_path, *overrides: str):
    return load_config(
        [],
        [
            f"output_dir='{tmp_path}'",
            "name=loop",
            "data.task='digit'",
            "orchestrator.mode='fully_async'",
            "orchestrator.max_staleness=1",
            "orchestrator.prompts_per_step=2",
            "orchestrator.max_inflight=4",
            "orchestrator.steps=4",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            *overrides,
        ],
    )


def waiting_groups(orchestrator: Orchestrator) -> int:
    """Scored groups generated and not trained yet (in the stream the next run() call collects from)."""
    results = orchestrator._results
    return 0 if results is None else results.statistics().current_buffer_used


async def settle(orchestrator: Orchestrator) -> None:
    """Wait until generation between run() calls went as far as the staleness bound lets it: every prompt the
    schedule admits was started (none past the run's last step's), none is generating, and their groups wait
    for the next call."""
    schedule, per_step = orchestrator.schedule, orchestrator.config.orchestrator.prompts_per_step
    run_prompts = orchestrator.config.orchestrator.steps * per_step
    await wait_until(
        lambda: (
            schedule.started == min(schedule.admission_limit, run_prompts)
            and schedule.inflight == 0
            and waiting_groups(orchestrator) == schedule.started - schedule.steps_done * per_step
        ),
        "generation reaches the staleness bound and its groups wait to be trained",
    )


def generation_stopped(orchestrator: Orchestrator, client: SlowClient) -> bool:
    """Generation ended (its task is gone) and no generate call is left in flight: nothing more can start."""
    return orchestrator._generation is None and client.in_flight == 0


@pytest.mark.slow
async def test_generation_goes_on_between_run_calls(tmp_path, monkeypatch, engine):
    """run(steps=1) in a loop (a notebook): the groups for the next steps generate between the calls, so a
    call finds its batch waiting; generation ends with the configured steps, and nothing is trained twice."""
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    config = loop_config(tmp_path)
    client = SlowClient(LocalInferenceClient([engine]), delay_s=0.3)
    async with Orchestrator(config, inference_client=client) as orchestrator:
        metrics = await orchestrator.run(steps=1)
        await settle(orchestrator)  # generation ran on after the call, up to the staleness bound
        assert client.calls > 2 * 2, "more groups than step 1 trained were generated"
        for _ in range(3):
            await settle(orchestrator)
            # Its batch is waiting: the call collects it without waiting for a generate call.
            assert waiting_groups(orchestrator) >= config.orchestrator.prompts_per_step
            metrics += await orchestrator.run(steps=1)
        assert orchestrator.state.step == 4
        assert generation_stopped(orchestrator, client), "generation stopped with the configured steps"
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    rollouts = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    trained = [r["prompt_index"] for r in rollouts]
    assert len(trained) == len(set(trained)) == 4 * 2


async def test_stop_ends_generation_left_running_between_calls(tmp_path, monkeypatch, engine):
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    client = SlowClient(LocalInferenceClient([engine]), delay_s=0.2)
    config = loop_config(tmp_path, "orchestrator.steps=10")
    orchestrator = await Orchestrator.start(config, inference_client=client)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(orchestrator.run, 1)
            # The first call waits for its batch (each generate takes 0.2 s).
            await wait_until(lambda: orchestrator._running, "the first run() call is running")
            with pytest.raises(RuntimeError, match="already running"):
                await orchestrator.run(steps=1)
        assert orchestrator.state.step == 1
    finally:
        await orchestrator.stop()
    assert generation_stopped(orchestrator, client), "nothing generates after stop()"


async def test_a_generation_error_ends_run_with_that_error(tmp_path, monkeypatch, engine):
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    client = SlowClient(LocalInferenceClient([engine]), delay_s=0.0, fail_at=7)
    async with Orchestrator(loop_config(tmp_path), inference_client=client) as orchestrator:
        with anyio.fail_after(30), pytest.raises(ExceptionGroup) as raised:
            await orchestrator.run()
        assert raised.group_contains(RuntimeError, match="the engine exploded")
        assert orchestrator.state.step < 4


async def test_a_fresh_run_starts_the_engines_on_its_weights_as_version_0(
    tmp_path, monkeypatch, tiny_model_dir
):
    """An engine that served an earlier run holds that run's weights and version: a new run first pushes its
    own weights as version 0, so samples never claim a version (or weights) the trainer did not publish."""
    import torch

    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    engine = TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=16, max_model_len=128)
    fresh = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    await engine.load_weights([(n, t + 0.5) for n, t in fresh.items()], policy_version=5)
    client = LocalInferenceClient([engine])
    try:
        async with Orchestrator(
            loop_config(tmp_path, "orchestrator.steps=1"), inference_client=client
        ) as orch:
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, fresh[name]), name
            assert engine.policy_version == 0
            metrics = await orch.run()
    finally:
        await client.close()
    assert metrics[0]["staleness_mean"] == 0.0 and metrics[0]["logprob_mismatch"] < 1e-4
