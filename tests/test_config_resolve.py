"""``resolve_config``: the ``auto`` values a config alone decides, resolved once before components see them;
``InferenceConfig.kind``: which of the three inference topologies a config is."""

from __future__ import annotations

import pytest

from rollflow.config import INFERENCE_MODE_ENV, load_config, resolve_config, starts_router


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)


@pytest.mark.parametrize(
    ("overrides", "off_policy", "strategy"),
    [
        ([], "none", "local"),
        (["orchestrator.mode='one_step'"], "tis", "local"),
        (["orchestrator.mode='fully_async'", "inference.mode='http'"], "tis", "broadcast"),
        (
            ["trainer.off_policy='decoupled'", "weight_sync.strategy='checkpoint'", "inference.mode='http'"],
            "decoupled",
            "checkpoint",
        ),
    ],
)
def test_auto_becomes_a_value(overrides, off_policy, strategy):
    config = load_config(overrides=overrides)
    resolved = resolve_config(config)
    assert (resolved.trainer.off_policy, resolved.weight_sync.strategy) == (off_policy, strategy)
    assert resolve_config(resolved) == resolved  # idempotent
    assert config.trainer.off_policy in ("auto", off_policy)  # the loaded config keeps what was written


def test_a_colocated_strategy_waits_for_the_devices():
    config = load_config(overrides=["inference.mode='http'", "inference.colocate=true"])
    assert resolve_config(config).weight_sync.strategy == "auto"  # cuda_ipc or broadcast: the barrier probes


@pytest.mark.parametrize(
    ("overrides", "router"),
    [
        ([], False),
        (["inference.mode='http'"], True),
        (["inference.mode='http'", "inference.num_servers=1"], False),
        (["inference.mode='http'", "inference.num_servers=1", "inference.router='always'"], True),
        (["inference.mode='http'", "inference.external_server_urls=['http://a:1']"], False),
        (["inference.mode='http'", "inference.external_server_urls=['http://a:1', 'http://b:1']"], True),
        (
            [
                "inference.mode='http'",
                "inference.external_proxy_url='http://p:1'",
                "inference.router='always'",
            ],
            False,
        ),
    ],
)
def test_whether_a_router_starts(overrides, router):
    assert starts_router(load_config(overrides=overrides).inference) is router


def test_inference_kind_follows_the_keys_users_write():
    assert load_config().inference.kind == "local"
    assert load_config(overrides=["inference.mode='http'"]).inference.kind == "managed"
    for external in (
        "inference.external_proxy_url='http://p:1'",
        "inference.external_server_urls=['http://s:1']",
    ):
        assert load_config(overrides=["inference.mode='http'", external]).inference.kind == "external"
