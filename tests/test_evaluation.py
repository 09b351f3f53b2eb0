"""Held-out evaluation ([eval]): during training between steps on the run's engines, offline with
``rollflow eval --checkpoint``, and its config errors."""

from __future__ import annotations

import json

import anyio
import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import ConfigError

from .helpers.data import case_rows, write_jsonl

# Whole runs, whose config takes $ROLLFLOW_INFERENCE_MODE (evaluation runs on the run's engines): the http pass runs them over HTTP.
pytestmark = pytest.mark.follows_mode

EVAL = [
    "orchestrator.prompts_per_step=2",
    "sampling.samples_per_prompt=2",
    "sampling.max_tokens=4",
    "eval.num_prompts=3",
    "eval.samples=2",
    "eval.every=1",
    "inference.router_port=0",  # runs in http mode start a router; tests run side by side
]


def sets(tmp_path, *extra: str) -> list[str]:
    return [f"output_dir='{tmp_path / 'runs'}'", "name=e", *EVAL, *extra]


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A 2-step run of the case task with eval before training and after each step."""
    tmp_path = tmp_path_factory.mktemp("eval")
    config = load_config([], sets(tmp_path, "orchestrator.steps=2"))

    async def train():
        async with Orchestrator(config) as orchestrator:
            metrics = await orchestrator.run()
            return metrics, orchestrator.eval_history

    metrics, history = anyio.run(train)
    return tmp_path, config, metrics, history


def test_eval_runs_before_training_and_every_step_without_touching_training(evaluated_run):
    _, config, metrics, history = evaluated_run
    assert [record["step"] for record in history] == [0, 1, 2]
    assert [record["eval/policy_version"] for record in history] == [0, 1, 2]
    for record in history:
        assert record["eval/num_prompts"] == 3
        for key in ("eval/greedy/reward_mean", "eval/sampled/reward_mean", "eval/sampled/pass@1"):
            assert 0.0 <= record[key] <= 1.0, key
        assert record["eval/sampled/pass@1"] <= record["eval/sampled/pass@2"]
    # Step metrics carry the eval of their step; the before-training eval is a record of its own (step 0).
    written = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in written] == [0, 1, 2]
    assert (
        "reward_mean" not in written[0]
        and written[0]["eval/greedy/reward_mean"] == history[0]["eval/greedy/reward_mean"]
    )
    # Evaluation samples are never trained and never counted as stale.
    rollouts = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_index"] for r in rollouts) == [0, 1, 2, 3]
    assert all(step["staleness_max"] == 0 and step["num_samples"] == 4 for step in metrics)


def test_offline_eval_of_the_initial_weights_matches_the_in_run_eval_before_training(evaluated_run, capsys):
    from rollflow.cli import main

    tmp_path, _, _, history = evaluated_run
    args = [a for value in sets(tmp_path, "name=offline") for a in ("--set", value)]
    (tmp_path / "empty.toml").write_text("")
    assert main(["eval", str(tmp_path / "empty.toml"), *args]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Greedy decoding of the same prompts on the same weights: the same completions, so the same reward.
    assert offline["eval/greedy/reward_mean"] == history[0]["eval/greedy/reward_mean"]
    assert offline["eval/policy_version"] == 0


def test_offline_eval_of_a_checkpoint(evaluated_run, capsys):
    from rollflow.cli import main

    tmp_path, config, _, _ = evaluated_run
    args = [a for value in sets(tmp_path, "name=offline2", "eval.samples=0") for a in ("--set", value)]
    (tmp_path / "empty.toml").write_text("")
    assert main(["eval", str(tmp_path / "empty.toml"), *args, "--checkpoint", str(config.run_dir)]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offline["eval/policy_version"] == 2
    assert "eval/sampled/reward_mean" not in offline
    assert 0.0 <= offline["eval/greedy/accuracy"] <= 1.0


def test_eval_of_a_held_out_file(tmp_path):
    from rollflow.rollout.evaluation import eval_task

    train = write_jsonl(tmp_path / "train.jsonl", case_rows(4))
    held_out = write_jsonl(tmp_path / "test.jsonl", case_rows(6, seed=9))
    config = load_config(
        [], [f"data.path='{train}'", "data.reward='case'", f"eval.path='{held_out}'", "eval.num_prompts=5"]
    )
    task = eval_task(config, config.eval)
    rows = case_rows(6, seed=9)
    assert [task.item(i).messages[0]["content"] for i in range(6)] == [
        r["prompt"] for r in rows
    ]  # file order


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.path='d.jsonl'", "data.reward='math'", "eval.every=2"], "would evaluate the training data"),
        (["eval.greedy=false"], "evaluates nothing"),
        (["eval.samples=2", "eval.temperature=0.0"], "eval.temperature = 0"),
        (["eval.max_tokens=5000"], "eval.max_tokens"),
        (["eval.num_prompts=0"], "eval.num_prompts"),
        (["eval.temperature=1e-9", "eval.samples=1"], "eval.temperature must be 0"),
    ],
)
def test_eval_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [f"output_dir='{tmp_path}'", *overrides])


async def test_a_resume_before_the_first_checkpoint_evaluates_before_training_once(tmp_path):
    config = load_config([], sets(tmp_path, "orchestrator.steps=2", "eval.every=0", "eval.samples=0"))
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run(steps=1)  # no checkpoint yet: the resume starts again from step 0
    async with Orchestrator(config, resume=True) as orchestrator:
        await orchestrator.run()
    written = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in written] == [0, 1, 2]
    assert "eval/greedy/accuracy" in written[0] and "eval/greedy/accuracy" in written[2]
    assert "eval/greedy/accuracy" not in written[1]  # eval.every = 0: before training and after the last step
