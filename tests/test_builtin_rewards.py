"""Built-in rewards: answer extraction, equivalence (with math-verify and without), exact, case, and how a
weighted sum reports a part that raises."""

from __future__ import annotations

import pytest

from rollflow.errors import ConfigError
from rollflow.messages import FinishReason, Sample
from rollflow.rollout import rewards
from rollflow.rollout.builtin_rewards import extract_answer, math_reward, normalise
from rollflow.rollout.rewards import REWARD_ERROR, Rewarder, resolve_reward
from rollflow.rollout.tasks import CaseTask, TaskItem


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{\\frac{3}{4}} in the end", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{x^{2}}", "x^{2}"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("I think 3 apples and then 1,250 pears.", "1,250"),
        ("no number at all", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("completion", "reference", "reward"),
    [
        ("The answer is \\boxed{72}.", "Natalia sold ... #### 72", 1.0),
        ("The answer is \\boxed{72}.", "#### 73", 0.0),
        ("It costs $1,250.00", "1250", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
        ("so x = 18", "18", 1.0),
        ("nothing to see", "18", 0.0),
    ],
)
def test_math_reward_normalises_numbers(completion, reference, reward):
    assert math_reward(completion, TaskItem(messages=[], answer=reference)) == reward


def test_math_reward_symbolic_equivalence_through_math_verify():
    pytest.importorskip("math_verify")
    item = TaskItem(messages=[], answer="\\sqrt{8}")
    assert normalise("2\\sqrt{2}") != normalise("\\sqrt{8}")  # no string normaliser sees these as equal
    assert math_reward("\\boxed{2\\sqrt{2}}", item) == 1.0
    assert math_reward("\\boxed{3\\sqrt{2}}", item) == 0.0


def test_runaway_answers_skip_the_symbolic_check():
    item = TaskItem(messages=[], answer="5")
    for answer in ("9^{9^{9^{9}}}", "10^{100000000}", "123456789!", "1e999999999"):
        assert math_reward(f"\\boxed{{{answer}}}", item) == 0.0  # returns at once instead of computing


def test_exact_and_case_rewards():
    exact = resolve_reward("exact", "data.reward")
    assert exact(" Paris\n", TaskItem(messages=[], answer="Paris")) == 1.0
    assert exact("paris", TaskItem(messages=[], answer="Paris")) == 0.0
    case = resolve_reward("case", "data.reward")
    task = CaseTask(0)
    for index in range(4):
        item = task.item(index)
        assert case("HELLO there", item) == task.reward("HELLO there", item)


def test_unknown_reward_name_is_a_config_error():
    with pytest.raises(ConfigError, match="data.rewards\\[1\\].fn = 'maths' is not a built-in reward"):
        resolve_reward("maths", "data.rewards[1].fn")


def boom(completion: str, item: TaskItem) -> float:
    if "x" in completion:
        raise RuntimeError("judge down")
    return 1.0


def sample(index: int, text: str) -> Sample:
    return Sample(
        prompt_index=7,
        sample_index=index,
        prompt_token_ids=[1],
        completion_token_ids=[2],
        logprobs=[0.0],
        policy_versions=[0],
        finish_reason=FinishReason.STOP,
        completion_text=text,
    )


async def test_a_raising_part_masks_only_its_sample_and_is_logged_with_its_name(monkeypatch):
    from types import SimpleNamespace

    parts = [
        SimpleNamespace(fn="exact", weight=2.0),
        SimpleNamespace(fn="tests.test_builtin_rewards:boom", weight=1.0),
    ]
    rewarder = Rewarder.from_config(None, CaseTask(0), parts)
    samples = [sample(0, "ok"), sample(1, "x")]
    logs: list[dict] = []
    # The module's logger itself: a logger configured and cached by an earlier test escapes capture_logs.
    monkeypatch.setattr(
        rewards.log, "warning", lambda event, **fields: logs.append({"event": event, **fields})
    )
    metrics = await rewarder.score(samples, TaskItem(messages=[], answer="ok", metadata={"row": 3}))
    assert samples[0].reward == 2.0 * 1.0 + 1.0 and not samples[0].masked
    assert samples[1].masked and samples[1].mask_reason == REWARD_ERROR
    assert metrics == {
        "reward_sum/exact": 1.0,
        "reward_count/exact": 1.0,
        "reward_sum/boom": 1.0,
        "reward_count/boom": 1.0,
    }
    [failure] = [entry for entry in logs if entry["event"] == "reward failed; sample masked"]
    assert failure["problem"] == "RewardPartError: reward 'boom': RuntimeError: judge down"
    assert failure["row"] == 3 and failure["reward"] == "data.rewards"


def test_a_dataset_without_a_reward_is_a_config_error():
    from rollflow.rollout.datasets import DatasetTask

    with pytest.raises(ConfigError, match="data.path is set but no reward is"):
        Rewarder.from_config(None, DatasetTask([{"prompt": "a"}]))
