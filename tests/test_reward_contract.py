"""One reward-value contract: any real number (numpy scalars and 0-d tensors included) becomes a float finite
in float32, everything else masks its sample with the reason; a reward raising ``SystemExit`` is a reward
failure; huge values never overflow the metrics or the advantages; and a run whose every sample is masked
stops with a clear error instead of running to the end having trained nothing."""

from __future__ import annotations

import asyncio
import math
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from rollflow import Orchestrator, load_config
from rollflow.errors import NothingToTrainError
from rollflow.rollout import rewards
from rollflow.rollout.rewards import REWARD_ERROR, Rewarder, WeightedReward, reward_value
from rollflow.rollout.tasks import TaskItem
from rollflow.train.advantages import compute_advantages

from .helpers.training import completion_samples

ITEM = TaskItem(messages=[], metadata={"row": 4, "line": 6})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.5, 0.5),
        (3, 3.0),
        (Fraction(1, 4), 0.25),
        (np.float32(0.5), 0.5),
        (np.float64(-1.5), -1.5),
        (np.int64(2), 2.0),
        (np.array(0.75), 0.75),
        (torch.tensor(0.25), 0.25),
        (torch.tensor(3, dtype=torch.int64), 3.0),
        (3.4e38, 3.4e38),
    ],
)
def test_real_numbers_of_any_type_become_floats(value, expected):
    assert reward_value(value) == expected and type(reward_value(value)) is float


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (True, "returned bool, expected a real number; return float"),
        (np.bool_(True), "returned bool, expected a real number"),  # np.bool_ is reported as what it holds
        ("1.0", "returned str, expected a real number"),
        (None, "returned NoneType"),
        ([1.0], "returned list"),
        (Decimal("0.5"), "returned Decimal"),
        (complex(1, 0), "returned complex"),
        (torch.tensor([1.0]), "returned Tensor"),  # not 0-d
        (10**400, "has no float value"),
        (10**5000, "has no float value"),  # no repr at all (int digit limit)
        (1e308, "finite in float32"),
        (-1e39, "finite in float32"),
        (math.nan, "finite in float32"),
        (math.inf, "finite in float32"),
        (np.float64(np.inf), "finite in float32"),
        (torch.tensor(float("nan")), "finite in float32"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, int) and value > 2**64 else None,
)
def test_everything_else_is_refused_with_the_problem(value, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        reward_value(value)


VALUES: dict[str, Any] = {
    "c0": np.float32(0.5),
    "c1": np.int64(1),
    "c2": torch.tensor(0.25),
    "c3": 10**400,
    "c4": 1e308,
    "c5": "high",
}


def typed_reward(completion: str, item: TaskItem) -> Any:
    return VALUES[completion]


async def async_typed_reward(completion: str, item: TaskItem) -> Any:
    return VALUES[completion]


@pytest.mark.parametrize("reward_fn", [typed_reward, async_typed_reward])
async def test_numpy_and_tensor_rewards_score_and_out_of_range_ones_are_masked(reward_fn, monkeypatch):
    logged: list[dict] = []
    monkeypatch.setattr(
        rewards.log, "warning", lambda event, **fields: logged.append({"event": event, **fields})
    )
    samples = completion_samples([f"c{index}" for index in range(6)])
    await Rewarder(reward_fn).score(samples, ITEM)
    assert [s.reward for s in samples] == [0.5, 1.0, 0.25, 0.0, 0.0, 0.0]
    assert [s.masked for s in samples] == [False, False, False, True, True, True]
    assert all(s.mask_reason == REWARD_ERROR for s in samples if s.masked)
    problems = {entry["sample_index"]: entry["problem"] for entry in logged}
    assert "has no float value" in problems[3] and "finite in float32" in problems[4]
    assert "returned str" in problems[5]
    assert all(entry["row"] == 4 and entry["line"] == 6 for entry in logged)


def exiting_reward(completion: str, item: TaskItem) -> float:
    if completion == "c1":
        raise SystemExit(3)
    return 1.0


async def async_exiting_reward(completion: str, item: TaskItem) -> float:
    return exiting_reward(completion, item)


@pytest.mark.parametrize("reward_fn", [exiting_reward, async_exiting_reward])
async def test_system_exit_from_a_reward_masks_its_sample(reward_fn):
    samples = completion_samples([f"c{index}" for index in range(3)])
    await Rewarder(reward_fn).score(samples, ITEM)
    assert [s.masked for s in samples] == [False, True, False]
    assert samples[1].mask_reason == REWARD_ERROR


async def test_cancellation_is_not_a_reward_failure():
    started = anyio.Event()

    async def waits(completion: str, item: TaskItem) -> float:
        started.set()
        await anyio.sleep(60)
        return 1.0

    samples = completion_samples([f"c{index}" for index in range(2)])
    with anyio.move_on_after(30) as outer:  # a generous deadline for the test itself
        async with anyio.create_task_group() as tg:
            tg.start_soon(Rewarder(waits).score, samples, ITEM)
            await started.wait()
            tg.cancel_scope.cancel()
    assert not outer.cancelled_caught
    assert not any(s.masked for s in samples)  # cancelled, not scored as failures


async def test_a_weighted_sum_beyond_float32_masks_the_sample():
    parts = [("big", lambda completion, item: 1e30, 1e10), ("ok", lambda completion, item: 1.0, 1.0)]
    samples = completion_samples([f"c{index}" for index in range(1)])
    metrics = await Rewarder(WeightedReward(parts), name="data.rewards").score(samples, ITEM)
    assert samples[0].masked and samples[0].mask_reason == REWARD_ERROR
    assert metrics == {}  # parts of a masked sample are not logged as scored


def test_advantages_of_huge_mixed_sign_rewards_do_not_raise():
    # The group's sums overflow float64 (fsum raised OverflowError): non-finite advantages instead, which
    # make the trainer skip the step.
    for method in ("grpo", "rloo"):
        values = compute_advantages([1e308, -1e308, 1e308], [True, True, True], method)  # type: ignore[arg-type]
        assert not all(math.isfinite(v) for v in values), method
    compute_advantages([1e308, -1e308, 1e308], [True, True, True], "grpo_no_std")
    # Within the contract (float32's range), every method stays finite.
    for method in ("grpo", "grpo_no_std", "rloo"):
        values = compute_advantages([3.4e38, -3.4e38, 0.0], [True, True, True], method)  # type: ignore[arg-type]
        assert all(math.isfinite(v) for v in values), method


def run_config(tmp_path: Path, *overrides: str):
    return load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=contract",
            "data.task='digit'",
            "orchestrator.prompts_per_step=2",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            "inference.router_port=0",  # runs in http mode start a router; tests run side by side
            *overrides,
        ],
    )


def float32_reward(completion: str, item: TaskItem) -> Any:
    return np.float32(1.0 if any(char.isdigit() for char in completion) else 0.0)


def bool_reward(completion: str, item: TaskItem) -> Any:
    return any(char.isdigit() for char in completion)


async def test_a_numpy_reward_trains(tmp_path):
    config = run_config(
        tmp_path, "orchestrator.steps=1", "data.reward='tests.test_reward_contract:float32_reward'"
    )
    async with Orchestrator(config) as orchestrator:
        [metrics] = await orchestrator.run()
    assert metrics["num_masked_samples"] == 0 and metrics["reward_errors"] == 0


async def test_a_run_whose_every_sample_is_masked_stops_after_max_masked_steps(tmp_path):
    config = run_config(
        tmp_path, "orchestrator.steps=20", "data.reward='tests.test_reward_contract:bool_reward'"
    )
    assert config.orchestrator.max_masked_steps == 3
    steps: list[dict] = []
    async with Orchestrator(config) as orchestrator:
        with pytest.raises(NothingToTrainError) as raised:
            await orchestrator.run(on_step=steps.append)
    assert [m["step"] for m in steps] == [1, 2]  # step 3's metrics are written, then the run stops
    message = str(raised.value)
    assert message.startswith("steps 1-3: every sample was masked (reward_error x12)")
    assert (
        "returned bool, expected a real number" in message and "orchestrator.max_masked_steps = 0" in message
    )
    lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3


async def test_max_masked_steps_0_runs_on_regardless(tmp_path):
    config = run_config(
        tmp_path,
        "orchestrator.steps=4",
        "orchestrator.max_masked_steps=0",
        "data.reward='tests.test_reward_contract:bool_reward'",
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    assert [m["num_masked_samples"] for m in metrics] == [4.0] * 4


def test_the_asyncio_cancellation_is_an_interruption():
    from rollflow.rollout.callbacks import is_interruption

    async def check() -> None:
        assert is_interruption(asyncio.CancelledError()) and is_interruption(KeyboardInterrupt())
        assert not is_interruption(SystemExit(3)) and not is_interruption(ValueError())

    anyio.run(check)
