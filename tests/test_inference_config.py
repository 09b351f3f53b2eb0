"""``[inference]`` config: modes, topologies, the environment override and errors that name the fields."""

from __future__ import annotations

import pytest

from rollflow.config import INFERENCE_MODE_ENV, load_config
from rollflow.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)


def test_defaults():
    inference = load_config().inference
    assert inference.mode == "local"
    assert inference.engine == "torch"
    assert inference.router_port == 8080
    assert inference.router_impl == "rollflow"
    assert inference.external_server_urls == []
    assert inference.health_check_interval_s > 0 and inference.startup_timeout_s > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["inference.mode='http'"],
        ["inference.mode='http'", "inference.router_port=0", "inference.num_servers=3"],
        ["inference.mode='http'", "inference.router_impl='vllm-router'"],
        ["inference.mode='http'", "inference.external_server_urls=['http://127.0.0.1:8000']"],
        ["inference.mode='http'", "inference.external_proxy_url='http://proxy:9000'"],
        [
            "inference.mode='http'",
            "inference.external_proxy_url='https://proxy.example.com'",
            "inference.external_server_urls=['http://10.0.0.1:8000', 'http://10.0.0.2:8000']",
        ],
        ["inference.mode='http'", "inference.engine='vllm'", "inference.colocate=true"],
    ],
)
def test_valid_topologies(overrides):
    assert load_config(overrides=overrides).inference.mode == "http"


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (
            ["inference.mode='http'", "inference.colocate=true", "inference.external_proxy_url='http://p:1'"],
            ["inference.colocate", "inference.external_proxy_url"],
        ),
        (
            [
                "inference.mode='http'",
                "inference.colocate=true",
                "inference.external_server_urls=['http://s:1']",
            ],
            ["inference.colocate", "inference.external_server_urls"],
        ),
        (
            ["inference.external_server_urls=['http://s:1']"],
            ["inference.external_server_urls", "inference.mode"],
        ),
        (["inference.engine='vllm'"], ["inference.engine", "inference.mode"]),
        (
            ["inference.mode='http'", "inference.external_proxy_url='proxy:9000'"],
            ["inference.external_proxy_url"],
        ),
        (
            ["inference.mode='http'", "inference.external_server_urls=['http://s:1/v1']"],
            ["inference.external_server_urls[0]"],
        ),
        (
            ["inference.mode='http'", "inference.external_server_urls=['http://s:1', 'http://s:1']"],
            ["inference.external_server_urls"],
        ),
        (["inference.mode='grpc'"], ["inference.mode"]),
        (["inference.engine='sglang'"], ["inference.engine"]),
        (["inference.router_port=70000"], ["inference.router_port"]),
        (["inference.request_timeout_s=0"], ["inference.request_timeout_s"]),
        (["inference.health_check_interval_s=-1"], ["inference.health_check_interval_s"]),
        (["inference.num_servers=0"], ["inference.num_servers"]),
        (["inference.router='never'"], ["inference.router"]),
        (["inference.router=true"], ["inference.router"]),
        (["inference.router_impl='nginx'"], ["inference.router_impl"]),
        (["inference.router_impl='vllm_router'"], ["inference.router_impl"]),
        (["inference.niceness=20"], ["inference.niceness"]),
        (["inference.niceness=-1"], ["inference.niceness"]),
        (["inference.niceness='low'"], ["inference.niceness"]),
    ],
)
def test_invalid_inference_config_names_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    for field in fields:
        assert field in str(info.value)


def test_environment_overrides_mode(monkeypatch, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[inference]\nmode = 'local'\n")
    monkeypatch.setenv(INFERENCE_MODE_ENV, "http")
    assert load_config([path]).inference.mode == "http"
    monkeypatch.setenv(INFERENCE_MODE_ENV, "local")
    assert load_config(overrides=["inference.mode='http'"]).inference.mode == "local"


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(INFERENCE_MODE_ENV, "remote")
    with pytest.raises(ConfigError, match=INFERENCE_MODE_ENV):
        load_config()
