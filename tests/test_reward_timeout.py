"""User callbacks under a named timeout: a reward that blocks (sync or async) masks its sample as
``reward_timeout`` (counted, logged) instead of stalling the run; a blocked sync reward holds up neither a
cancellation nor the process's exit (SIGTERM stops ``rollflow run`` promptly); a reward that keeps blocking
stops the run with a clear error; a custom task's ``item`` is timed too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import anyio
import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import CallbackTimeoutError, StuckCallbacksError
from rollflow.rollout import rewards
from rollflow.rollout.callbacks import CallbackRunner, abandoned_calls
from rollflow.rollout.rewards import REWARD_TIMEOUT, Rewarder
from rollflow.rollout.tasks import CaseTask, TaskItem, item_caller

from .conftest import REPO_ROOT
from .helpers.training import completion_samples
from .helpers.waits import wait_until_sync

ITEM = TaskItem(messages=[], metadata={"row": 2})
RELEASE = threading.Event()  # set at the end of each test: blocked reward threads then return
# The timeout of the calls that block: far above what an unblocked call takes on a busy machine (at 0.3 s, a
# task's first item, called while the run was still starting, once ran past it), far below the 120 s they block.
TIMEOUT_S = 1.5


@pytest.fixture(autouse=True)
def _release_blocked_threads():
    RELEASE.clear()
    before = abandoned_calls()  # other modules' abandoned calls may still be running: not this test's
    yield
    RELEASE.set()
    # This test's calls count as abandoned until they return; let them, so no other test sees them.
    wait_until_sync(
        lambda: abandoned_calls() <= before,
        lambda: f"this test's blocked reward calls return ({abandoned_calls() - before} still running)",
    )


def blocking_reward(completion: str, item: TaskItem) -> float:
    if completion == "block":
        RELEASE.wait(120)  # the test releases it; a deadline keeps a broken test from leaking it for ever
    return 1.0


async def async_blocking_reward(completion: str, item: TaskItem) -> float:
    if completion == "block":
        await anyio.sleep(120)
    return 1.0


@pytest.mark.parametrize("reward_fn", [blocking_reward, async_blocking_reward])
async def test_a_reward_past_its_timeout_masks_only_its_sample_and_is_logged(reward_fn, monkeypatch):
    logged: list[dict] = []
    monkeypatch.setattr(
        rewards.log, "warning", lambda event, **fields: logged.append({"event": event, **fields})
    )
    samples = completion_samples(["a", "block", "b"])
    started = time.monotonic()
    await Rewarder(reward_fn, name="slow", timeout_s=TIMEOUT_S).score(samples, ITEM)
    assert time.monotonic() - started < 60  # the reward itself would take 120 s
    assert [s.masked for s in samples] == [False, True, False]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert samples[1].mask_reason == REWARD_TIMEOUT
    [entry] = logged
    assert entry["reason"] == REWARD_TIMEOUT and entry["row"] == 2 and entry["sample_index"] == 1
    assert entry["problem"] == f"reward 'slow' ran past data.reward_timeout_s = {TIMEOUT_S} s"


async def test_cancelling_stops_waiting_for_a_blocked_sync_reward_at_once():
    threads: list[threading.Thread] = []

    def blocks(completion: str, item: TaskItem) -> float:
        threads.append(threading.current_thread())
        RELEASE.wait(120)
        return 1.0

    rewarder = Rewarder(blocks, timeout_s=600)
    with anyio.move_on_after(30) as deadline:  # the test's own, generous deadline
        async with anyio.create_task_group() as tg:
            tg.start_soon(rewarder.score, completion_samples(["block"]), ITEM)
            while not threads:
                await anyio.sleep(0.01)
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()
    assert not deadline.cancelled_caught
    # The blocked thread (held until RELEASE) was left behind, not waited for.
    assert time.monotonic() - cancelled_at < 20
    assert threads[0].is_alive()
    # This call is counted (earlier tests' abandoned calls may still be running too): `rollflow` exits
    # without joining it.
    assert rewarder.runner.stuck == 1 and abandoned_calls() >= 1
    RELEASE.set()
    # Counted down when the abandoned call returns (its thread then waits for the next call).
    deadline_at = time.monotonic() + 30
    while rewarder.runner.stuck and time.monotonic() < deadline_at:
        await anyio.sleep(0.01)
    assert rewarder.runner.stuck == 0


async def test_calls_still_stuck_past_max_stuck_stop_the_run_with_a_clear_error():
    runner = CallbackRunner(
        lambda: RELEASE.wait(120),
        name="reward 'judge'",
        timeout_s=0.1,
        timeout_key="data.reward_timeout_s",
        max_stuck=2,
    )
    for _ in range(2):
        with pytest.raises(
            CallbackTimeoutError, match="reward 'judge' ran past data.reward_timeout_s = 0.1 s"
        ):
            await runner()
    with pytest.raises(
        StuckCallbacksError, match="reward 'judge': 2 of its calls ran past data.reward_timeout_s"
    ):
        await runner()


async def test_a_call_cancelled_before_its_thread_starts_is_not_counted_as_stuck():
    # Cancelled right after it was handed to a worker thread, most calls are dropped before they run
    # (anyio skips a cancelled job): such a call holds no thread and must not count towards max_stuck,
    # or a run cancelled often (timeouts on a busy machine) would stop with a false StuckCallbacksError.
    ran = []
    runner = CallbackRunner(
        lambda: ran.append(1), name="reward 'quick'", timeout_s=60, timeout_key="data.reward_timeout_s"
    )
    for _ in range(200):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            await anyio.sleep(0)
            tg.cancel_scope.cancel()
    # The calls that did start return at once; none is left counted.
    await anyio.to_thread.run_sync(lambda: None)
    deadline_at = time.monotonic() + 30
    while runner.stuck and time.monotonic() < deadline_at:
        await anyio.sleep(0.01)
    assert runner.stuck == 0
    assert len(ran) < 200  # most never ran: the test did exercise the cancelled-before-start case
    assert await runner() is None and len(ran) >= 1


class SlowTask:
    """A custom task whose ``item`` blocks at index 3."""

    name = "slow"

    def item(self, index: int) -> TaskItem:
        if index == 3:
            RELEASE.wait(120)
        return TaskItem(messages=[{"role": "user", "content": str(index)}])

    def reward(self, completion: str, item: TaskItem) -> float:
        return 0.0


async def test_a_custom_tasks_item_runs_under_data_task_timeout_s():
    item_of = item_caller(SlowTask(), timeout_s=TIMEOUT_S)
    assert (await item_of(1)).messages[0]["content"] == "1"
    with pytest.raises(
        CallbackTimeoutError,
        match=rf"data.task 'slow': item\(3\) ran past data.task_timeout_s = {TIMEOUT_S} s",
    ):
        await item_of(3)
    # Built-in tasks are lookups, called on the event loop.
    task = CaseTask(0)
    assert await item_caller(task, timeout_s=TIMEOUT_S)(5) == task.item(5)


def slow_task(seed: int) -> SlowTask:
    return SlowTask()


async def test_a_run_whose_custom_task_blocks_fails_naming_the_task_and_index(tmp_path):
    config = load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=slowtask",
            "data.task='tests.test_reward_timeout:slow_task'",
            f"data.task_timeout_s={TIMEOUT_S}",
            "orchestrator.prompts_per_step=2",
            "orchestrator.steps=3",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        with pytest.raises(
            CallbackTimeoutError, match=rf"item\(3\) ran past data.task_timeout_s = {TIMEOUT_S} s"
        ):
            await orchestrator.run()
        assert orchestrator.state.step == 1  # prompts 0 and 1 trained; prompt 3 never came


calls = {"n": 0}


def first_call_blocks(completion: str, item: TaskItem) -> float:
    calls["n"] += 1
    if calls["n"] == 1:
        RELEASE.wait(120)
    return 1.0 if any(char.isdigit() for char in completion) else 0.0


async def test_a_run_counts_timed_out_rewards_and_goes_on(tmp_path):
    calls["n"] = 0
    config = load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=timeout",
            "data.task='digit'",
            "data.reward='tests.test_reward_timeout:first_call_blocks'",
            f"data.reward_timeout_s={TIMEOUT_S}",
            "orchestrator.prompts_per_step=2",
            "orchestrator.steps=2",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    assert [m["reward_timeouts"] for m in metrics] == [1, 0]
    assert [m["num_masked_samples"] for m in metrics] == [1.0, 0.0]
    assert all(m["reward_errors"] == 0 for m in metrics)


BLOCKING_REWARD = """
import pathlib, time

def block(completion, item):
    pathlib.Path({marker!r}).touch()
    time.sleep(600)
    return 1.0
"""


@pytest.mark.slow
def test_sigterm_stops_a_run_promptly_while_a_sync_reward_blocks(tmp_path):
    marker = tmp_path / "reward-started"
    (tmp_path / "blockreward.py").write_text(BLOCKING_REWARD.format(marker=str(marker)))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollflow",
            "run",
            str(REPO_ROOT / "examples" / "quickstart.toml"),
            "--no-progress",
            "--set",
            f"output_dir='{tmp_path / 'runs'}'",
            "--set",
            "data.reward='blockreward:block'",
            "--set",
            "orchestrator.prompts_per_step=2",
            "--set",
            "sampling.samples_per_prompt=2",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert process.poll() is None, process.stderr.read()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the reward was never called"
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the run was still alive 60 s after SIGTERM (a blocked reward held it)")
        stopped_in = time.monotonic() - sent
        stderr = process.stderr.read()  # type: ignore[union-attr]
        assert returncode == 143, stderr[-3000:]
        assert "terminated (SIGTERM)" in stderr and "exiting without waiting for" in stderr
        assert stopped_in < 30, stopped_in  # about a second on an idle machine
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
