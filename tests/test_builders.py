"""``rollflow run``, ``generate``, ``eval`` and ``proxy`` build their parts through the same builders
(``rollflow.orchestrator.builders``): what a config says reaches every command."""

from __future__ import annotations

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.orchestrator.builders import build_agent_generator, build_proxy, load_chat, open_generator
from rollflow.rollout.generator import SingleTurnGenerator


@pytest.fixture(scope="module")
def chat():
    return load_chat(load_config())


@pytest.mark.parametrize("partial_rollouts", [True, False])
async def test_the_single_turn_generator_keeps_partial_rollouts(chat, partial_rollouts):
    tokenizer, renderer = chat
    config = load_config([], [f"orchestrator.partial_rollouts={str(partial_rollouts).lower()}"])
    async with open_generator(config, None, renderer, tokenizer, task=None, rewarder=object()) as generator:
        assert isinstance(generator, SingleTurnGenerator)
        assert generator.partial_rollouts is partial_rollouts
        assert generator.sampling == config.sampling and generator.seed == config.seed


def test_the_proxy_carries_the_engines_limits_and_the_agents_listener(chat):
    tokenizer, renderer = chat
    config = load_config(
        [],
        [
            "inference.return_routed_experts=true",
            "inference.max_batch_size=5",
            "inference.max_model_len=300",
            "sampling.max_tokens=7",
            "sampling.top_k=4",
            "agent.callable='x.py:f'",
            "agent.max_seq_len=64",
            "agent.host='0.0.0.0'",
            "agent.port=8123",
            "agent.enforce_sampling=false",
            "agent.strict_requests=true",
        ],
    )
    proxy = build_proxy(config, None, renderer, tokenizer)
    assert (proxy.host, proxy.port, proxy.max_n, proxy.max_model_len) == ("0.0.0.0", 8123, 5, 300)
    assert proxy.strict_requests and proxy.settings.return_routed_experts
    settings = proxy.settings
    assert (settings.default_max_tokens, settings.default_top_k, settings.enforce_sampling) == (7, 4, False)
    # Without [agent] (the standalone proxy): loopback, a free port, the run's sampling enforced.
    plain = build_proxy(load_config(), None, renderer, tokenizer, port=0)
    assert (plain.host, plain.port, plain.settings.enforce_sampling, plain.strict_requests) == (
        "127.0.0.1",
        0,
        True,
        False,
    )


async def test_the_agent_generator_needs_an_agent_section_and_a_sequence_length(chat):
    tokenizer, renderer = chat
    with pytest.raises(ConfigError, match=r"\[agent\] section"):
        async with build_agent_generator(load_config(), None, renderer, tokenizer):
            pass


def test_the_agents_proxy_runs_in_workers_with_the_in_process_proxys_options(chat):
    import pickle

    from rollflow.orchestrator.builders import build_agent_proxy, proxy_options
    from rollflow.tito.proxy import TITOProxy
    from rollflow.tito.workers import ProxyWorkers

    tokenizer, renderer = chat
    sets = [
        "agent.callable='x.py:f'",
        "agent.max_seq_len=64",
        "agent.strict_requests=true",
        "sampling.top_k=4",
    ]
    in_process = build_agent_proxy(load_config([], sets), None, renderer, tokenizer)
    assert isinstance(in_process, TITOProxy) and in_process.strict_requests
    config = load_config([], [*sets, "agent.proxy_workers=2"])
    workers = build_agent_proxy(config, None, renderer, tokenizer)
    assert isinstance(workers, ProxyWorkers) and workers.num_workers == 2
    assert workers.model_name == in_process.model_name == config.model.path
    # What each worker is sent: the same keyword arguments, which cross the process boundary intact.
    options = proxy_options(config)
    assert pickle.loads(pickle.dumps(options)) == options
    assert (options["strict_requests"], options["default_top_k"], options["port"]) == (True, 4, 0)
    assert proxy_options(config, host="::1", port=9, admin_token="t") == {
        **options,
        "host": "::1",
        "port": 9,
        "admin_token": "t",
    }
