"""Adapter versions in flight (``TorchEngine(adapter_versions=N)``): a request started on adapter version k
finishes on k while k + 1 is pushed, every token records k, new requests run on k + 1, and a push that finds
every version still decoding fails naming the setting. In-process engines here; ``rollflow serve`` in
``test_adapter_versions_server.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.errors import EngineError
from rollflow.inference.engine.engine import TorchEngine
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm

from .helpers.adapters import random_adapter

PROMPT = [5, 17, 42, 99, 3]
# Long enough to be still decoding when the test pauses the engine (each test checks that it is).
LONG = SamplingParams(max_tokens=600, temperature=1.0, seed=11)
SAME = 48


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).eval()


def engine_of(base_model, **options) -> TorchEngine:
    return TorchEngine(copy.deepcopy(base_model), max_batch_size=4, max_model_len=640, **options)


async def alone_on(base_model, adapter, version: int) -> list[int]:
    """The tokens of the long request on an engine that only ever held ``adapter`` (merged)."""
    engine = engine_of(base_model)
    try:
        await engine.load_weights(list(adapter.items()), policy_version=version)
        return (await engine.generate(GenerateRequest(PROMPT, LONG))).token_ids
    finally:
        await engine.shutdown()


async def test_a_request_started_on_version_k_finishes_on_k(base_model):
    first, second = random_adapter(base_model, 1), random_adapter(base_model, 2)
    engine = engine_of(base_model, adapter_versions=2)
    try:
        await engine.load_weights(list(first.items()), policy_version=1)
        stream = engine.generate_stream(GenerateRequest(PROMPT, LONG))
        head = await anext(stream)  # running now, on version 1
        await engine.pause("keep")
        assert engine.num_running == 1, "the request finished before the push: make LONG longer"
        await engine.load_weights(list(second.items()), policy_version=2)
        await engine.resume()
        chunks = [head] + [chunk async for chunk in stream]
        fresh = await engine.generate(GenerateRequest(PROMPT, LONG))
    finally:
        await engine.shutdown()
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    versions = [version for chunk in chunks for version in chunk.policy_versions]
    assert len(tokens) == LONG.max_tokens and len(head.token_ids) < LONG.max_tokens
    assert set(versions) == {1}
    # The first tokens: unmerged and merged round differently, which over hundreds of samples could flip one.
    assert tokens[:SAME] == (await alone_on(base_model, first, 1))[:SAME]
    assert set(fresh.policy_versions) == {2}
    assert fresh.token_ids[:SAME] == (await alone_on(base_model, second, 2))[:SAME]
    # The two versions sample differently: the checks above tell them apart.
    assert fresh.token_ids[:SAME] != tokens[:SAME]


async def test_a_push_with_every_version_still_decoding_fails_naming_the_setting(base_model):
    engine = engine_of(base_model, adapter_versions=2)
    try:
        await engine.load_weights(list(random_adapter(base_model, 1).items()), policy_version=1)
        one = engine.generate_stream(GenerateRequest(PROMPT, LONG))
        await anext(one)
        await engine.pause("keep")
        assert engine.num_running == 1
        await engine.load_weights(list(random_adapter(base_model, 2).items()), policy_version=2)
        await engine.resume()
        two = engine.generate_stream(GenerateRequest(PROMPT, LONG))
        await anext(two)
        await engine.pause("keep")
        assert engine.num_running == 2
        with pytest.raises(EngineError, match="--adapter-versions"):
            await engine.load_weights(list(random_adapter(base_model, 3).items()), policy_version=3)
        assert engine.policy_version == 2  # the refused push changed nothing
        await engine.resume()
        assert {v for chunk in [c async for c in one] for v in chunk.policy_versions} == {1}
        assert {v for chunk in [c async for c in two] for v in chunk.policy_versions} == {2}
        # Both finished: the oldest slot is free again.
        await engine.load_weights(list(random_adapter(base_model, 3).items()), policy_version=3)
    finally:
        await engine.shutdown()


async def test_unmerged_serving_matches_merged_serving(base_model):
    adapter = random_adapter(base_model, 4)
    engine = engine_of(base_model, adapter_versions=1)
    try:
        await engine.load_weights(list(adapter.items()), policy_version=1)
        output = await engine.generate(GenerateRequest(PROMPT, LONG))
        checksums = engine.adapter_checksums()
    finally:
        await engine.shutdown()
    assert output.token_ids[:SAME] == (await alone_on(base_model, adapter, 1))[:SAME]
    assert sorted(checksums) == sorted(adapter)
    with pytest.raises(ValueError, match="adapter_versions must be >= 1"):
        from rollflow.inference.engine.adapter_versions import AdapterVersions

        AdapterVersions(base_model, 0)
    assert torch.equal(base_model.lm_head.weight, base_model.model.embed_tokens.weight)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["orchestrator.mode='fully_async'", "orchestrator.max_staleness=2", "trainer.lora.rank=4"], 3),
        (["orchestrator.mode='one_step'", "trainer.lora.rank=4"], 3),
        (["orchestrator.mode='sync'", "trainer.lora.rank=4"], 0),
        (["orchestrator.mode='fully_async'"], 0),
    ],
)
def test_async_lora_runs_give_the_engines_max_staleness_plus_one_versions(overrides, expected):
    from rollflow.config import load_config
    from rollflow.inference.setup import adapter_versions, server_options

    config = load_config([], overrides)
    assert adapter_versions(config) == expected
    extra = server_options(config, None)["extra_args"]
    assert (extra[:2] == ["--adapter-versions", str(expected)]) == bool(expected)


def test_a_negative_adapter_versions_flag_is_refused_naming_it():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "rollflow", "serve", "--model", "rollflow:tiny", "--adapter-versions", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--adapter-versions" in result.stderr and "non-negative" in result.stderr


def _perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """Full weights (HF names) of ``model`` with noise: a full-weight push that changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + torch.randn(tensor.shape, generator=generator) * 0.05
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and name != "lm_head.weight"  # tied: the embeddings carry it
    }


async def test_full_and_adapter_pushes_mix_on_the_unmerged_path(base_model):
    """Adapter v1, then full weights v2, then adapter v3 into an engine keeping versions unmerged: new
    requests then sample as an engine that held the full weights with adapter v3 merged, stamped v3; and
    after the full push alone, as the full weights with adapter v1 (full weights load into the base, which
    every kept version runs on)."""
    first, second = random_adapter(base_model, 1), random_adapter(base_model, 3)
    full = _perturbed(base_model, 2)
    new_base = copy.deepcopy(base_model)
    new_base.load_state_dict(full, strict=False)
    engine = engine_of(base_model, adapter_versions=2)
    try:
        await engine.load_weights(list(first.items()), policy_version=1)
        await engine.load_weights(list(full.items()), policy_version=2)
        after_full = await engine.generate(GenerateRequest(PROMPT, LONG))
        await engine.load_weights(list(second.items()), policy_version=3)
        after_second = await engine.generate(GenerateRequest(PROMPT, LONG))
    finally:
        await engine.shutdown()
    assert set(after_second.policy_versions) == {3}
    assert after_second.token_ids[:SAME] == (await alone_on(new_base, second, 3))[:SAME]
    assert after_full.token_ids[:SAME] == (await alone_on(new_base, first, 1))[:SAME]
    # The full push changed what is sampled: the checks above tell the two bases apart.
    assert after_full.token_ids[:SAME] != (await alone_on(base_model, first, 1))[:SAME]
