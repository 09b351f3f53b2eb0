"""rollflow's built-in rewards are scored on the event loop (no thread hand-off per sample); a user's sync
reward still runs in a worker thread under its timeout."""

from __future__ import annotations

import threading

import pytest

from rollflow.rollout.builtin_rewards import BUILTIN_REWARDS
from rollflow.rollout.callbacks import mark_inline
from rollflow.rollout.rewards import REWARD_ERROR, Rewarder
from rollflow.rollout.tasks import BUILTIN_TASKS, CaseTask, TaskItem

from .helpers.training import completion_samples

UPPER = TaskItem(messages=[], answer="upper")


def threads_of(fn):
    seen: list[str] = []

    def spy(completion, item):
        seen.append(threading.current_thread().name)
        return fn(completion, item)

    return spy, seen


async def test_built_in_rewards_and_tasks_are_inline():
    assert Rewarder.from_config("case", CaseTask(0)).runner.inline
    assert Rewarder.from_config("exact", CaseTask(0)).runner.inline
    assert not Rewarder.from_config("math", CaseTask(0)).runner.inline  # math_verify may take a while
    for name, factory in BUILTIN_TASKS.items():
        assert Rewarder.from_config(None, factory(0)).runner.inline, name


async def test_an_inline_reward_runs_on_the_loop_and_scores_as_before():
    spy, seen = threads_of(BUILTIN_REWARDS["case"])
    samples = completion_samples(["HELLO", "hello", "HeLLo"])
    await Rewarder(mark_inline(spy), name="case").score(samples, UPPER)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.6]
    assert seen == [threading.current_thread().name] * 3


async def test_a_user_sync_reward_keeps_its_worker_thread():
    spy, seen = threads_of(BUILTIN_REWARDS["case"])
    samples = completion_samples(["HELLO", "hello"])
    await Rewarder(spy, name="mine").score(samples, UPPER)
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert len(seen) == 2 and threading.current_thread().name not in seen


async def test_an_inline_reward_that_raises_masks_its_sample():
    samples = completion_samples(["HELLO"])
    await Rewarder.from_config("case", CaseTask(0)).score(samples, TaskItem(messages=[], answer="title"))
    assert samples[0].masked and samples[0].mask_reason == REWARD_ERROR


@pytest.mark.parametrize("name", ["case", "exact"])
def test_the_mark_is_on_the_function(name):
    assert getattr(BUILTIN_REWARDS[name], "rollflow_inline", False)
