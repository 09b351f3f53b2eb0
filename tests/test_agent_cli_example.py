"""``examples/agent_cli``: a run whose agent is Codex CLI (``agent.command``), rewarded by the task
directory's check script, on the tiny model on CPU. The config and its parts are checked everywhere; the run
itself needs Codex (``scripts/install_agent_clis.sh``; CI installs it) and skips, saying so, without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rollflow.config import load_config
from tests.helpers.harness import REPO_ROOT, cli_dir, cli_path

EXAMPLE = REPO_ROOT / "examples" / "agent_cli"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"agent_cli_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_parses_and_its_task_and_check_script_work():
    config = load_config([EXAMPLE / "config.toml"])
    assert config.agent.command and config.agent.side_calls.models == ["rollflow-side"]
    assert (
        config.model.path == "rollflow:tiny-long"
        and config.agent.max_seq_len <= config.inference.max_model_len
    )
    item = _load("tasks").NotesTask().item(3)
    asked = item.messages[0]["content"].split()[2]
    assert f"{asked}: {item.answer}\n" in item.metadata["files"]["notes.txt"]
    check = _load("check")
    assert check.reward("", "7") == 0.0 and check.reward("about 12", "7") == 0.5
    assert check.reward("7", "7") == 1.0


@pytest.mark.slow
@pytest.mark.agent_cli
def test_two_steps_train_with_codex_as_the_agent(tmp_path):
    if cli_path("codex") is None:
        pytest.skip("codex is not installed: run scripts/install_agent_clis.sh (CI does)")
    sets = [
        "orchestrator.steps=2",
        "orchestrator.prompts_per_step=1",
        "sampling.samples_per_prompt=2",
        f"output_dir={tmp_path}",
    ]
    command = [sys.executable, "-m", "rollflow", "run", "examples/agent_cli/config.toml", "--no-progress"]
    for value in sets:
        command += ["--set", value]
    env = {**os.environ, "ROLLFLOW_AGENT_CLI_DIR": str(cli_dir()), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "agent_cli" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert record["agent_trajectories"] == 2 and record["agent_errors"] == record["agent_timeouts"] == 0
        assert record["agent_turns"] >= 2 and record["num_samples"] >= 2  # Codex called the model
        assert 0.0 <= record["reward_mean"] <= 1.0 and record["agent_masked_samples"] == 0
