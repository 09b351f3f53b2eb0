"""``[env]``: the config section of environments users bring; bad keys and values are errors naming them."""

from __future__ import annotations

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError

from .conftest import REPO_ROOT

ENV = ["env.kind='verifiers'", "env.id='case_env'", "env.max_seq_len=64"]


def test_env_section_loads_with_defaults():
    config = load_config([], ENV)
    assert config.env.kind == "verifiers" and config.env.on_failure == "refill"
    assert config.env.max_retries == 2 and config.env.max_failure_rate == 0.5


def test_example_config_loads_and_resolves_its_env_file():
    config = load_config([REPO_ROOT / "examples" / "envs" / "verifiers_case.toml"])
    assert config.env.id == str(REPO_ROOT / "examples" / "envs" / "case_env.py")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env.kind='gym'"], "env.kind = 'gym' must be one of 'verifiers', 'openenv'"),
        (["env.kind='harbor'"], "harbor package needs Python >= 3.12"),
        (["env.id=' '"], "env.id is empty"),
        (
            ["env.max_seq_len=4", "sampling.max_tokens=8"],
            "env.max_seq_len (4) must be >= sampling.max_tokens",
        ),
        (["env.max_failure_rate=0.0"], "env.max_failure_rate = 0.0 must be in (0, 1]"),
        (["env.max_failure_rate=1.5"], "env.max_failure_rate = 1.5 must be in (0, 1]"),
        (["env.min_group_samples=9", "sampling.samples_per_prompt=8"], "env.min_group_samples (9)"),
        (["env.on_failure='retry'"], "env.on_failure"),
        (["env.max_retries=-1"], "env.max_retries"),
        (["env.retries=3"], "env.retries"),
        (["env.url='http://127.0.0.1:8000'"], "env.url, env.server and env.server_dir are for env.kind"),
        (["env.kind='openenv'"], "exactly one of env.url"),
        (["env.kind='openenv'", "env.server='echo'"], "env.server = 'echo' must name the server's ASGI app"),
        (["env.kind='openenv'", "env.url='127.0.0.1:8000'"], "must be a base URL"),
        (["env.kind='openenv'", "env.url='http://x:1'", "env.max_turns=0"], "env.max_turns"),
        (["data.reward='math'"], "data.reward and data.rewards are not used with [env]"),
        (["agent.callable='m:f'", "agent.max_seq_len=64"], "[env] and [agent] are both set"),
        (["env.num_tasks=4", "eval.split='test'"], "eval.split is not used with [env]"),
        (["env.num_tasks=4", "eval.path='x.jsonl'"], "eval.path is not used with [env]"),
        (["eval.num_prompts=4"], "[eval] with [env] needs env.num_tasks"),
        (
            ["env.kind='openenv'", "env.url='http://x:1'", "eval.env_args={seed = 1}"],
            "eval.env_args is for env.kind = 'verifiers', not 'openenv'",
        ),
        (["env.num_tasks=4", "eval.env_args=3"], "eval.env_args"),
    ],
)
def test_bad_env_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config([], [*ENV, *overrides])
    assert message in str(error.value)


def test_missing_max_seq_len_is_named():
    with pytest.raises(ConfigError, match="env.max_seq_len must be set"):
        load_config([], ["env.kind='verifiers'", "env.id='x'"])


def test_eval_with_env_loads():
    config = load_config([], [*ENV, "env.num_tasks=4", "eval.num_prompts=2"])
    assert config.eval.env_args is None and config.env.num_tasks == 4
    config = load_config([], [*ENV, "eval.env_args={taskset = {seed = 1}}"])
    assert config.eval.env_args == {"taskset": {"seed": 1}}


def test_eval_env_args_without_env_is_named():
    with pytest.raises(ConfigError, match="eval.env_args is for a held-out \\[env\\] environment"):
        load_config([], ["eval.env_args={taskset = {seed = 1}}"])
