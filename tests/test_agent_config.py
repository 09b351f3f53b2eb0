"""The ``[agent]`` config section: its rules name every field involved; agent and file-path resolution."""

from __future__ import annotations

import json
import typing

import pytest

from rollflow.config import AgentConfig, load_config, to_dict
from rollflow.errors import ConfigError

from .conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "agent_tito" / "config.toml"
AGENT = ["agent.callable='pkg.mod:agent'", "agent.max_seq_len=512"]


def test_example_config_parses_and_its_task_and_agent_resolve(monkeypatch):
    from rollflow.rollout.agent import resolve_agent
    from rollflow.rollout.tasks import load_task

    config = load_config([EXAMPLE])
    assert config.agent is not None and config.agent.max_seq_len == 1024
    monkeypatch.chdir(REPO_ROOT)  # the example's paths are relative to the repository root
    task = load_task(config.data.task, config.data.seed)
    item = task.item(0)
    assert item.messages[0]["content"].startswith("What is") and isinstance(item.answer, int)
    assert task.reward(f"IT IS {item.answer}", item) == 1.0
    assert task.reward(f"it is {item.answer + 1}", item) == 0.0
    assert resolve_agent(config.agent.callable).__name__ == "run_agent"


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["agent.max_seq_len=512"], ["agent.callable", "agent.command"]),
        ([*AGENT, "agent.command=['x']"], ["agent.callable", "agent.command"]),
        (["agent.callable='pkg.mod:agent'"], ["agent.max_seq_len"]),
        (
            [*AGENT, "agent.max_seq_len=4", "sampling.max_tokens=8"],
            ["agent.max_seq_len", "sampling.max_tokens"],
        ),
        (["agent.command=' '", "agent.max_seq_len=512"], ["agent.command"]),
        (["agent.command=[]", "agent.max_seq_len=512"], ["agent.command"]),
        ([*AGENT, "agent.env={A='1'}"], ["agent.env", "agent.command"]),
        ([*AGENT, "data.reward='pkg.mod:reward'"], ["data.reward"]),
        ([*AGENT, "agent.timeout_s=0"], ["agent.timeout_s"]),
        ([*AGENT, "agent.mode='whole'"], ["agent.mode"]),
        ([*AGENT, "agent.max_seq_len=0"], ["agent.max_seq_len"]),
        ([*AGENT, "agent.max_concurrent=0"], ["agent.max_concurrent"]),
        ([*AGENT, "agent.timeout=3"], ["agent.timeout"]),
        ([*AGENT, "agent.enforce_sampling='yes'"], ["agent.enforce_sampling"]),
        ([*AGENT, "agent.enforce_sampling=1"], ["agent.enforce_sampling"]),
        ([*AGENT, "agent.strict_requests='no'"], ["agent.strict_requests"]),
        ([*AGENT, "agent.host=''"], ["agent.host"]),
        ([*AGENT, "agent.host='http://0.0.0.0'"], ["agent.host"]),
        ([*AGENT, "agent.host=7"], ["agent.host"]),
        ([*AGENT, "agent.advertise_url='proxy:8100'"], ["agent.advertise_url"]),
        ([*AGENT, "agent.advertise_url='http://proxy:8100/v1'"], ["agent.advertise_url"]),
        ([*AGENT, "agent.port=70000"], ["agent.port"]),
        ([*AGENT, "agent.save_traces='some'"], ["agent.save_traces"]),
        ([*AGENT, "agent.proxy_workers=-1"], ["agent.proxy_workers", ">= 0"]),
        ([*AGENT, "agent.proxy_workers='two'"], ["agent.proxy_workers", "int"]),
        (
            [*AGENT, "agent.proxy_workers=2", "agent.port=8123"],
            ["agent.proxy_workers = 2", "agent.port = 8123"],
        ),
        (
            [*AGENT, "agent.proxy_workers=2", "agent.advertise_url='http://proxy:8100'"],
            ["agent.proxy_workers = 2", "agent.advertise_url = 'http://proxy:8100'"],
        ),
    ],
)
def test_agent_rules_name_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as error:
        load_config([], overrides)
    for field in fields:
        assert field in str(error.value)


def test_valid_agent_configs_and_json_round_trip(tmp_path):
    config = load_config([], AGENT)
    assert config.agent.mode == "per_branch" and config.agent.timeout_s > 0
    assert config.agent.enforce_sampling is True
    assert load_config([], [*AGENT, "agent.enforce_sampling=false"]).agent.enforce_sampling is False
    command = load_config([], ["agent.command='python agent.py'", "agent.max_seq_len=8", "agent.env={A='1'}"])
    assert command.agent.command == "python agent.py" and command.agent.env == {"A": "1"}
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(to_dict(command)))
    assert load_config([saved]) == command
    assert load_config([]).agent is None


def test_proxy_workers_default_to_the_run_process_and_one_worker_may_keep_its_listener(tmp_path):
    assert load_config([], AGENT).agent.proxy_workers == 0
    assert load_config([], [*AGENT, "agent.proxy_workers=4"]).agent.proxy_workers == 4
    one = load_config(
        [], [*AGENT, "agent.proxy_workers=1", "agent.port=8123", "agent.advertise_url='http://h:1'"]
    )
    assert (one.agent.proxy_workers, one.agent.port, one.agent.advertise_url) == (1, 8123, "http://h:1")
    config = tmp_path / "config.toml"
    config.write_text('[agent]\ncallable = "pkg.mod:agent"\nmax_seq_len = 512\nproxy_workers = "two"\n')
    with pytest.raises(ConfigError, match=r"config\.toml.*agent\.proxy_workers.*Expected `int`, got `str`"):
        load_config([config])


def test_config_modes_are_the_composer_modes():
    from rollflow.tito import COMPOSE_MODES

    assert typing.get_args(typing.get_type_hints(AgentConfig)["mode"]) == COMPOSE_MODES


def test_resolve_agent_rules(tmp_path):
    from rollflow.rollout.agent import CommandAgent, resolve_agent

    def sync_agent(base_url, task):
        return 1.0

    async def async_agent(base_url, task):
        return 1.0

    with pytest.raises(ConfigError, match="async"):
        resolve_agent(sync_agent)
    with pytest.raises(ConfigError, match="exactly one"):
        resolve_agent(async_agent, ["x"])
    assert resolve_agent(async_agent) is async_agent
    assert isinstance(resolve_agent(command=["python", "x.py"]), CommandAgent)
    with pytest.raises(ConfigError, match="agent.callable"):
        resolve_agent(str(tmp_path / "missing.py") + ":run")


def test_import_object_loads_a_file_once(tmp_path):
    from rollflow.imports import import_object

    path = tmp_path / "user_code.py"
    path.write_text("CALLS = []\nCALLS.append(1)\ndef fn():\n    return len(CALLS)\n")
    first = import_object(f"{path}:fn", key="k")
    assert first() == 1 and import_object(f"{path}:fn", key="k") is first
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="boom"):
        import_object(f"{broken}:fn", key="k")
    with pytest.raises(ConfigError, match="has no attribute"):
        import_object(f"{path}:nothing", key="k")
