"""``inference.return_routed_experts``: validated, and it reaches in-process engines and the servers rollflow
starts (``rollflow serve --enable-return-routed-experts``, ``vllm serve --enable-return-routed-experts``)."""

from __future__ import annotations

import pytest

from rollflow.config import INFERENCE_MODE_ENV, build_config, load_config
from rollflow.errors import ConfigError, EngineError
from rollflow.launch.server_group import build_torch_server_command, build_vllm_server_command
from rollflow.messages import GenerateRequest, SamplingParams

REQUEST = GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)


def test_off_by_default_and_a_bool():
    assert load_config().inference.return_routed_experts is False
    assert load_config(overrides=["inference.return_routed_experts=true"]).inference.return_routed_experts


@pytest.mark.parametrize("value", ["'yes'", "1", "[true]"])
def test_wrong_types_name_the_field(value):
    with pytest.raises(ConfigError, match=r"inference\.return_routed_experts") as info:
        load_config(overrides=[f"inference.return_routed_experts={value}"])
    assert "bool" in str(info.value)


def test_command_lines_carry_the_flag_only_when_on():
    for build in (build_torch_server_command, lambda m, **kw: build_vllm_server_command(m, port=1, **kw)):
        assert "--enable-return-routed-experts" not in build("m")[0]
        assert "--enable-return-routed-experts" in build("m", return_routed_experts=True)[0]


def config(tmp_path, model: str, **inference):
    return build_config(
        {
            "output_dir": str(tmp_path),
            "model": {"path": model},
            "inference": {
                "return_routed_experts": True,
                "max_model_len": 128,
                "max_batch_size": 2,
                **inference,
            },
        }
    )


@pytest.mark.local_only(reason="the local topology with routes on")
async def test_local_engines_return_routes(tmp_path):
    from rollflow.inference.setup import get_inference_client

    async with get_inference_client(config(tmp_path, "rollflow:tiny-moe")) as client:
        output = await client.generate(REQUEST)
    assert output.routed_experts.shape == (len(REQUEST.prompt_token_ids) + 3 - 1, 2, 2)


async def test_a_dense_model_fails_at_start_naming_the_setting(tmp_path):
    from rollflow.inference.setup import get_inference_client

    with pytest.raises(EngineError, match=r"inference\.return_routed_experts = false"):
        async with get_inference_client(config(tmp_path, "rollflow:tiny")):
            pass


@pytest.mark.slow
@pytest.mark.http_only(reason="the http topology with routes on")
async def test_servers_rollflow_starts_return_routes(tmp_path):
    from rollflow.inference.setup import get_inference_client

    http = config(tmp_path, "rollflow:tiny-moe", mode="http", num_servers=1, router_port=0)
    async with get_inference_client(http) as client:
        output = await client.generate(REQUEST)
    assert output.routed_experts.shape == (len(REQUEST.prompt_token_ids) + 3 - 1, 2, 2)
    log = (tmp_path / "run" / "logs" / "inference" / "server-0.log").read_text()
    assert "--enable-return-routed-experts" in log
