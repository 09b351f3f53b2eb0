"""Config loading: precedence, unknown keys, bad values and cross-field rules, all with named keys."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.config import RunConfig, load_config, parse_override, to_dict
from rollflow.errors import ConfigError

from .conftest import REPO_ROOT


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_are_valid():
    config = load_config()
    assert isinstance(config, RunConfig)
    assert config.model.path == "rollflow:tiny"
    assert config.orchestrator.mode == "sync"


def test_later_files_and_overrides_win(tmp_path):
    a = write(tmp_path / "a.toml", "[trainer]\nlr = 0.1\nmax_grad_norm = 2.0\n[sampling]\nmax_tokens = 4\n")
    b = write(tmp_path / "b.toml", "[trainer]\nlr = 0.2\n")
    config = load_config([a, b], ["trainer.max_grad_norm=3.5"])
    assert config.trainer.lr == 0.2  # b over a
    assert config.trainer.max_grad_norm == 3.5  # --set over files
    assert config.sampling.max_tokens == 4  # untouched keys from a survive the merge


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.lr=3e-4", {"trainer": {"lr": 3e-4}}),
        ("name=my-run", {"name": "my-run"}),
        ('name="quoted"', {"name": "quoted"}),
        ("trainer.betas=[0.8, 0.9]", {"trainer": {"betas": [0.8, 0.9]}}),
        ("model.enable_thinking=true", {"model": {"enable_thinking": True}}),
    ],
)
def test_parse_override(override, expected):
    assert parse_override(override) == expected


@pytest.mark.parametrize("override", ["trainer.lr", "=3", "trainer..lr=1", "trainer.l-r=1"])
def test_malformed_override_is_an_error(override):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override(override)


def test_unknown_key_in_file_names_the_key_path(tmp_path):
    path = write(tmp_path / "c.toml", "[trainer]\nlrr = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.lrr'") as info:
        load_config([path])
    assert str(path) in str(info.value)


def test_unknown_top_level_section(tmp_path):
    path = write(tmp_path / "c.toml", "[trainr]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'trainr'"):
        load_config([path])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.lr=-1", "trainer.lr"),
        ("trainer.lr='fast'", "trainer.lr"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("sampling.samples_per_prompt=0", "sampling.samples_per_prompt"),
        ("trainer.advantage='ppo'", "trainer.advantage"),
        ("orchestrator.mode='turbo'", "orchestrator.mode"),
        ("trainer.betas=[0.9]", "trainer.betas"),
        ("checkpoint.every=-1", "checkpoint.every"),
        ("trainer.placement='gpu'", "trainer.placement"),
        ("trainer.placement=1", "trainer.placement"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"invalid value for '{key}'"):
        load_config([], [override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "sampling.temperature=1e-300",
            r"sampling\.temperature must be 0 \(greedy\) or between 1e-05 and 10000, got 1e-300",
        ),
        ("sampling.temperature=1e5", r"sampling\.temperature must be .* got 100000\.0"),
        ("sampling.temperature=inf", r"sampling\.temperature must be a finite number"),
        ("sampling.top_p=1e-300", r"sampling\.top_p must be in \[1e-08, 1\].* got 1e-300.*top_k = 1"),
        ("sampling.top_k=-3", r"sampling\.top_k must be -1 or 0 \(disabled\) or a positive integer, got -3"),
        ("trainer.lr=inf", r"trainer\.lr must be a finite number"),
        ("trainer.lr=nan", r"invalid value for 'trainer\.lr'"),
        (
            "trainer.betas=[2.0, -1.0]",
            r"trainer\.betas\[0\] = 2\.0 must be in \[0, 1\).*trainer\.betas\[1\] = -1\.0",
        ),
        ("trainer.betas=[0.9, 1.0]", r"trainer\.betas\[1\] = 1\.0 must be in \[0, 1\)"),
        ("trainer.betas=[nan, 0.999]", r"trainer\.betas\[0\] must be a finite number"),
        ("trainer.max_grad_norm=inf", r"trainer\.max_grad_norm must be a finite number"),
        ("trainer.weight_decay=inf", r"trainer\.weight_decay must be a finite number"),
        ("trainer.clip_high=inf", r"trainer\.clip_high must be a finite number"),
        ("trainer.kl_coef=inf", r"trainer\.kl_coef must be a finite number"),
        ("trainer.tis_cap=inf", r"trainer\.tis_cap must be a finite number"),
        ("weight_sync.timeout_s=inf", r"weight_sync\.timeout_s must be a finite number"),
    ],
)
def test_numbers_the_sampler_or_optimizer_cannot_use_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [override])


def test_sampling_bounds_accept_their_edges():
    config = load_config([], ["sampling.temperature=1e-5", "sampling.top_p=1e-8", "trainer.betas=[0.0, 0.0]"])
    assert (config.sampling.temperature, config.sampling.top_p) == (1e-5, 1e-8)
    assert load_config([], ["sampling.temperature=1e4", "sampling.top_k=0"]).sampling.temperature == 1e4


def test_cross_field_rules_name_every_field():
    with pytest.raises(ConfigError) as info:
        load_config([], ["trainer.advantage='rloo'", "sampling.samples_per_prompt=1"])
    assert "trainer.advantage" in str(info.value) and "sampling.samples_per_prompt" in str(info.value)
    with pytest.raises(ConfigError, match=r"sampling\.max_tokens.*inference\.max_model_len"):
        load_config([], ["sampling.max_tokens=64", "inference.max_model_len=64"])
    with pytest.raises(ConfigError, match=r"sampling\.temperature = 0"):
        load_config([], ["sampling.temperature=0"])
    with pytest.raises(ConfigError, match="name"):
        load_config([], ["name='../escape'"])


@pytest.mark.parametrize("name", [".", "..", "", "a/b", "/abs", "../escape", "a b"])
def test_run_names_that_are_not_one_directory_are_rejected(name):
    with pytest.raises(ConfigError, match=rf"name = {re.escape(repr(name))} must be a plain directory name"):
        load_config([], [f"name={json.dumps(name)}"])


@pytest.mark.parametrize("name", ["run.1", "a_b-c", "..x", "v1.2.3"])
def test_plain_run_names_are_accepted(name):
    assert load_config([], [f"name={json.dumps(name)}"]).run_dir.name == name


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "missing.toml"])
    bad = write(tmp_path / "bad.toml", "[trainer\nlr = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config([bad])


def test_resolved_config_round_trips_through_json(tmp_path):
    config = load_config([], ["trainer.lr=0.5", "name=x"])
    saved = write(tmp_path / "config.json", json.dumps(to_dict(config)))
    assert load_config([saved]) == config


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "examples").rglob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_parses(path):
    load_config([path])


def rollflow_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_cli_dry_run_prints_resolved_config(tmp_path):
    result = rollflow_cli(
        "run",
        str(REPO_ROOT / "examples" / "quickstart.toml"),
        "--set",
        "trainer.lr=3e-4",
        "--dry-run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["trainer"]["lr"] == 3e-4
    assert resolved["name"] == "quickstart"
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "trainer.lrr=1"], "trainer.lrr"),
        (["--set", "sampling.temperature=-0.5"], "sampling.temperature"),
        (["--set", "sampling.temperature=1e-300"], "sampling.temperature"),
        (["--set", "trainer.betas=[2.0, -1.0]"], "trainer.betas[0]"),
        (["--set", "nonsense"], "KEY=VALUE"),
    ],
)
def test_cli_config_error_exits_2_naming_the_key(tmp_path, args, message):
    result = rollflow_cli("run", str(REPO_ROOT / "examples" / "quickstart.toml"), *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_bad_arguments_exit_2(tmp_path):
    assert rollflow_cli("run", cwd=tmp_path).returncode == 2  # no config at all
    assert rollflow_cli("run", "missing.toml", cwd=tmp_path).returncode == 2
    assert rollflow_cli("run", "--resume", str(tmp_path / "nope"), cwd=tmp_path).returncode == 2
    assert rollflow_cli("fly", cwd=tmp_path).returncode == 2


def test_weight_sync_strategy_must_fit_the_inference_mode(monkeypatch):
    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)  # the first case is about the default mode
    with pytest.raises(ConfigError, match=r"weight_sync\.strategy = 'broadcast'.*inference\.mode = 'local'"):
        load_config([], ["weight_sync.strategy='broadcast'"])
    with pytest.raises(ConfigError, match=r"weight_sync\.strategy = 'local'.*inference\.mode = 'http'"):
        load_config([], ["weight_sync.strategy='local'", "inference.mode='http'"])
    config = load_config([], ["inference.mode='http'"])
    assert config.weight_sync.resolved_strategy(config.inference.mode) == "broadcast"


def test_shortening_an_example_run_is_valid():
    """The README's notebook snippet: fewer steps than checkpoint.every still checkpoints at the end."""
    config = load_config([REPO_ROOT / "examples" / "quickstart.toml"], ["orchestrator.steps=3"])
    assert config.orchestrator.steps == 3 and config.checkpoint.every == 50
