"""examples/math: the config parses, and its GSM8K preparation script turns a tiny fixture into data that the
config's task, reward and eval read."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec

from rollflow import load_config
from rollflow.rollout.builtin_rewards import math_reward
from rollflow.rollout.datasets import task_from_config
from rollflow.rollout.evaluation import eval_task

from .conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "math"

GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72.\n#### 72",
    },
    {
        "question": "A shirt costs $1,200 and is 50% off. What does it cost?",
        "answer": "1200/2 = 600\n#### 600",
    },
    {"question": "A row without a final answer.", "answer": "no marker here"},
]


def test_math_config_parses_with_sane_defaults():
    config = load_config([EXAMPLE / "config.toml"])
    assert config.data.reward == "math" and config.eval is not None and config.eval.split == "test"
    assert config.trainer.lr <= 1e-5 and config.trainer.warmup_steps > 0
    assert config.sampling.max_tokens >= 512


def test_prepare_script_output_feeds_the_config(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    out = tmp_path / "data"
    script = EXAMPLE / "prepare_gsm8k.py"
    done = subprocess.run(
        [sys.executable, script, "--input", source, "--test-input", source, "--output", out],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == {
        "train": {"written": 2, "skipped": 1},
        "test": {"written": 2, "skipped": 1},
    }
    config = load_config([EXAMPLE / "config.toml"], [f"data.path='{out}'"])
    task = task_from_config(config.data)
    items = sorted((task.item(i) for i in range(len(task))), key=lambda item: item.answer)
    assert [item.answer for item in items] == ["600", "72"]
    assert items[1].messages[-1] == {"role": "user", "content": GSM8K_ROWS[0]["question"]}
    assert math_reward("So the total is \\boxed{72}.", items[1]) == 1.0
    assert math_reward("It costs \\boxed{600} dollars", items[0]) == 1.0
    held_out = eval_task(config, msgspec.structs.replace(config.eval))
    assert len(held_out) == 2
