"""``data.path = "reasoning-gym:NAME"``: reasoning-gym tasks by name as the run's data, scored through the
run's ``Rewarder`` by the task's own scorer; the scores match ``score_answer`` of a dataset reasoning-gym
builds itself (same name, seed and size) on 100 completions per task."""

from __future__ import annotations

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.messages import FinishReason, Sample
from rollflow.rollout.datasets import task_from_config
from rollflow.rollout.rewards import Rewarder
from tests.helpers.imports import needs

pytestmark = needs("reasoning_gym", "pip install 'rollflow[envs]'")

TASKS = ["basic_arithmetic", "leg_counting", "word_sorting"]


def completions(answer: str, index: int) -> str:
    """Right, wrong, padded and partly right answers, in turn."""
    return [
        answer,
        f"The answer is {answer}.",
        f"  {answer}  ",
        answer[: max(1, len(answer) // 2)],
        "I do not know",
        "",
        answer + answer,
        answer.upper(),
        answer.replace(" ", ""),
        f"<answer>{answer}</answer>",
    ][index % 10]


def sample(text: str) -> Sample:
    return Sample(0, 0, [], [], [], [], FinishReason.STOP, completion_text=text)


@pytest.mark.parametrize("name", TASKS)
async def test_scorer_matches_score_answer_on_100_completions(name):
    config = load_config([], [f"data.path='reasoning-gym:{name}'", "data.seed=7", "data.args={size = 100}"])
    task = task_from_config(config.data)
    rewarder = Rewarder.from_config(config.data.reward, task, config.data.rewards, timeout_s=60)
    import reasoning_gym

    own = reasoning_gym.create_dataset(name, seed=7, size=100)
    assert len(task) == 100
    scores, matched = [], 0
    for index in range(100):
        item = task.item(index)
        entry = own[index]
        assert item.messages == [{"role": "user", "content": entry["question"]}]
        text = completions(entry["answer"], index)
        scored = sample(text)
        await rewarder.score([scored], item)
        assert not scored.masked
        expected = own.score_answer(text, entry)
        assert scored.reward == pytest.approx(expected, abs=1e-9)
        matched += 1
        scores.append(scored.reward)
    assert matched == 100
    assert max(scores) == 1.0 and min(scores) < 1.0  # the completions tell right from wrong


def test_unknown_task_and_bad_size_are_config_errors():
    with pytest.raises(ConfigError, match="reasoning-gym has no task 'basic_arith'"):
        task_from_config(load_config([], ["data.path='reasoning-gym:basic_arith'"]).data)
    with pytest.raises(ConfigError, match=r"data.args.size = 0"):
        task_from_config(
            load_config([], ["data.path='reasoning-gym:chain_sum'", "data.args={size = 0}"]).data
        )
