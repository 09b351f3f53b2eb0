"""Small things of loading a config: one path is enough, file paths resolve relative to the config that names
them, ``ROLLFLOW_INFERENCE_MODE`` against the config's mode is logged, and the embedded API logs at info."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.config import load_config, mode_override
from rollflow.errors import ConfigError

from .conftest import REPO_ROOT


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", [str, Path])
def test_one_config_path_is_enough(tmp_path, kind):
    path = write(tmp_path / "one.toml", 'name = "single"\n[trainer]\nlr = 0.25\n')
    config = load_config(kind(path))
    assert config.name == "single" and config.trainer.lr == 0.25
    assert load_config(kind(path), "trainer.lr=0.5").trainer.lr == 0.5  # one override, too
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(kind(tmp_path / "missing.toml"))


AGENT_PY = """
from rollflow.rollout.tasks import Task, TaskItem


class PathTask(Task):
    def __len__(self):
        return 1

    def item(self, index):
        return TaskItem(messages=[{"role": "user", "content": "hi"}], answer=1)


async def agent(base_url, task):
    return 1.0


def reward(sample, item):
    return 1.0
"""


def test_file_paths_resolve_relative_to_the_config_that_names_them(tmp_path, monkeypatch):
    project = tmp_path / "project"
    write(project / "agent.py", AGENT_PY)
    write(project / "data" / "train.jsonl", '{"prompt": "hi", "answer": "1"}\n')
    base = write(
        project / "configs" / "base.toml",
        '[data]\ntask = "../agent.py:PathTask"\npath = "../data/train.jsonl"\n'
        '[agent]\ncallable = "../agent.py:agent"\nmax_seq_len = 64\n',
    )
    overlay = write(
        tmp_path / "elsewhere" / "overlay.toml", '[agent]\ncomposer = "../project/agent.py:reward"\n'
    )
    monkeypatch.chdir(tmp_path / "elsewhere")  # neither config's directory
    config = load_config([base, overlay])
    assert config.data.task == f"{project / 'agent.py'}:PathTask"
    assert config.agent.callable == f"{project / 'agent.py'}:agent"
    assert config.agent.composer == f"{project / 'agent.py'}:reward"  # relative to the overlay
    assert config.data.path == str(project / "data" / "train.jsonl")
    # Rewards too; a built-in name stays a name.
    rewards = write(project / "rewards.toml", '[data]\nrewards = [{fn = "agent.py:reward"}, {fn = "case"}]\n')
    assert [part.fn for part in load_config(rewards).data.rewards] == [
        f"{project / 'agent.py'}:reward",
        "case",
    ]
    reward = write(project / "reward.toml", '[data]\nreward = "agent.py:reward"\n')
    assert load_config(reward).data.reward == f"{project / 'agent.py'}:reward"


def test_paths_that_are_not_under_the_config_stay_as_written(tmp_path, monkeypatch):
    """Built-in names, module paths, dataset names and paths relative to the working directory (the
    examples' habit) are not rewritten; ``--set`` values are never rewritten."""
    write(tmp_path / "run" / "data.jsonl", '{"prompt": "hi", "answer": "1"}\n')
    path = write(
        tmp_path / "configs" / "run.toml",
        '[data]\ntask = "my_package.tasks:Task"\npath = "run/data.jsonl"\nreward = "case"\n',
    )
    monkeypatch.chdir(tmp_path)
    config = load_config(path, "eval.path=run/data.jsonl")
    assert config.data.task == "my_package.tasks:Task" and config.data.reward == "case"
    assert config.data.path == "run/data.jsonl" and config.eval.path == "run/data.jsonl"
    agent = write(
        tmp_path / "configs" / "agent.toml", '[agent]\ncallable = "nowhere.py:agent"\nmax_seq_len = 64\n'
    )
    assert load_config(agent).agent.callable == "nowhere.py:agent"
    with pytest.raises(ConfigError, match="data.path"):  # bad input still names the key
        load_config(path, "data.path=3")


@pytest.mark.slow
def test_the_agent_example_runs_from_any_directory(tmp_path):
    """``rollflow generate path/to/config.toml`` from another directory finds the agent file next to it."""
    config = REPO_ROOT / "examples" / "agent_tito" / "config.toml"
    output = tmp_path / "samples.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLOW_INFERENCE_MODE"}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "rollflow", "--log-level", "warning", "generate", str(config)),
            *("--num-prompts", "1", "--output", str(output), "--set", f"output_dir='{tmp_path / 'runs'}'"),
            *("--set", "sampling.samples_per_prompt=1", "--set", "inference.mode='local'"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert len(output.read_text().splitlines()) >= 1


def test_an_inference_mode_from_the_environment_against_the_config_is_logged(tmp_path, monkeypatch):
    warnings = []

    class Recorder:  # the module's logger may be cached by an earlier CLI test's structlog configuration
        def warning(self, event, **fields):
            warnings.append((event, fields))

    monkeypatch.setattr(mode_override, "log", Recorder())
    path = write(tmp_path / "http.toml", '[inference]\nmode = "http"\n')
    monkeypatch.setenv("ROLLFLOW_INFERENCE_MODE", "local")
    assert load_config(path).inference.mode == "local"
    assert len(warnings) == 1 and "inference.mode = 'http'" in warnings[0][0]
    assert warnings[0][1] == {"env": "local", "config": "http"}
    load_config(write(tmp_path / "local.toml", '[inference]\nmode = "local"\n'))  # agrees: no warning
    load_config([])  # the config says nothing: no warning
    assert len(warnings) == 1
    monkeypatch.setenv("ROLLFLOW_INFERENCE_MODE", "remote")
    with pytest.raises(ConfigError, match="ROLLFLOW_INFERENCE_MODE='remote' must be 'local' or 'http'"):
        load_config(path)


EMBEDDED = """
import asyncio, json, sys
import structlog
from rollflow import Orchestrator, load_config

async def main():
    config = load_config([], ["orchestrator.steps=1", "output_dir='{output}'", "inference.mode='local'"])
    orchestrator = await Orchestrator.start(config)
    try:
        await orchestrator.run()
    finally:
        await orchestrator.stop()

asyncio.run(main())
"""


@pytest.mark.slow
def test_the_embedded_api_logs_at_info_unless_logging_is_configured(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLOW_INFERENCE_MODE"}
    result = subprocess.run(
        [sys.executable, "-c", EMBEDDED.format(output=tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    logged = result.stdout + result.stderr
    assert "orchestrator ready" in logged  # info
    assert "[debug" not in logged and "weights updated" not in logged  # the barrier's debug line
    # A configuration the caller made is kept.
    code = (
        "import logging, structlog\n"
        "from rollflow.orchestrator.orchestrator import default_log_level\n"
        "structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))\n"
        "default_log_level()\n"
        "print(structlog.get_config()['wrapper_class'].__name__)\n"
    )
    kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert kept.stdout.strip() == "BoundLoggerFilteringAtDebug", kept.stderr
