"""Built-in tasks, reward loading, and reward failures masking single samples."""

from __future__ import annotations

import math

import pytest

from rollflow.errors import ConfigError
from rollflow.messages import FinishReason, Sample
from rollflow.rollout.rewards import REWARD_ERROR, Rewarder
from rollflow.rollout.tasks import CaseTask, DigitTask, TaskItem, load_task


def test_case_task_is_deterministic_and_prompt_dependent():
    task = CaseTask(seed=3)
    assert task.item(7) == CaseTask(seed=3).item(7)
    assert task.item(7) != CaseTask(seed=4).item(7) or task.item(8) != CaseTask(seed=4).item(8)
    cases = {task.item(index).answer for index in range(50)}
    assert cases == {"upper", "lower"}  # the prompt decides which case is right
    for index in range(50):
        item = task.item(index)
        wants_upper = item.answer == "upper"
        assert ("UPPERCASE" in item.messages[0]["content"]) == wants_upper


def test_case_reward_depends_on_the_prompt():
    task = CaseTask()
    upper = TaskItem(messages=[], answer="upper")
    lower = TaskItem(messages=[], answer="lower")
    assert task.reward("APPLE", upper) == 1.0
    assert task.reward("APPLE", lower) == 0.0
    assert task.reward("Apple", lower) == pytest.approx(0.8)
    assert task.reward("123 !", upper) == 0.0  # no letters, no reward


def test_digit_reward():
    assert DigitTask().reward("abc 4", TaskItem(messages=[])) == 1.0
    assert DigitTask().reward("abc", TaskItem(messages=[])) == 0.0


def test_load_task_builtin_and_import_path():
    assert isinstance(load_task("case", 0), CaseTask)
    assert isinstance(load_task("rollflow.rollout.tasks:DigitTask", 0), DigitTask)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cases", "not a built-in task"),
        ("no_such_module:Task", "cannot import module"),
        ("rollflow.rollout.tasks:Nope", "has no attribute"),
        ("rollflow.rollout.tasks:SUBJECTS", "not callable"),
        ("builtins:dict", "calling it with the seed failed"),
        ("builtins:str", "lacks the Task methods"),
    ],
)
def test_load_task_errors_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_task(spec, 0)
    assert "data.task" in str(info.value)


def make_samples(texts: list[str]) -> list[Sample]:
    return [
        Sample(
            prompt_index=0,
            sample_index=index,
            prompt_token_ids=[1],
            completion_token_ids=[2],
            logprobs=[-1.0],
            policy_versions=[0],
            finish_reason=FinishReason.STOP,
            completion_text=text,
        )
        for index, text in enumerate(texts)
    ]


def picky_reward(completion: str, item: TaskItem) -> float:
    if completion == "boom":
        raise RuntimeError("reward crashed")
    if completion == "nan":
        return math.nan
    if completion == "str":
        return "high"  # type: ignore[return-value]
    return float(len(completion))


async def async_picky_reward(completion: str, item: TaskItem) -> float:
    return picky_reward(completion, item)


@pytest.mark.parametrize("reward_fn", [picky_reward, async_picky_reward])
async def test_reward_failures_mask_only_that_sample(reward_fn):
    samples = make_samples(["ab", "boom", "nan", "str", "abcd"])
    await Rewarder(reward_fn).score(samples, TaskItem(messages=[]))
    assert [sample.reward for sample in samples] == [2.0, 0.0, 0.0, 0.0, 4.0]
    assert [sample.masked for sample in samples] == [False, True, True, True, False]
    assert all(s.mask_reason == REWARD_ERROR for s in samples if s.masked)


def test_reward_override_from_config_path():
    rewarder = Rewarder.from_config("tests.test_tasks:picky_reward", CaseTask())
    assert rewarder.reward_fn is picky_reward
    with pytest.raises(ConfigError, match="data.reward"):
        Rewarder.from_config("tests.test_tasks", CaseTask())
