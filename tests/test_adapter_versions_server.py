"""Adapter versions in flight on a real ``rollflow serve`` (``--adapter-versions 2``): a long request started
on adapter version k keeps k on every token while the trainer's k + 1 goes through the weight barrier (pause
``keep``, checkpoint push, proof of delivery, resume); a server without the flag, driven the same way, mixes
the two versions in that request, which shows the request really was in flight over the push."""

from __future__ import annotations

import copy

import pytest

from rollflow.config import LoraConfig, TrainerConfig
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer
from rollflow.weights import WeightTransfer, create_strategy

from .helpers.training import make_batch

pytestmark = [pytest.mark.slow, pytest.mark.http_only(reason="private servers")]

TIMEOUT_S = 60.0
# Long enough that the push lands while it decodes (the merged server's mixed versions check that it did).
LONG = SamplingParams(max_tokens=1500, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def make_server(tmp_path_factory, *extra: str):
    from .helpers.servers import BackgroundServerGroup

    options = {"extra_args": list(extra)}
    return BackgroundServerGroup(1, tmp_path_factory.mktemp("adapter-versions"), server_options=options)


async def straddle(url: str, base_model) -> tuple[set[int], int, set[int], int]:
    """Push version k, start the long request, push k + 1 while it runs, then one more request: the first
    request's versions and length, the second's versions, and k."""
    import anyio

    trainer = Trainer(copy.deepcopy(base_model), TrainerConfig(lr=0.05, lora=LoraConfig(rank=4, alpha=8.0)))
    client = RemoteInferenceClient(url, [url], control_timeout_s=TIMEOUT_S)
    strategy = create_strategy("checkpoint", timeout_s=TIMEOUT_S)
    barrier = WeightBarrier(client, WeightTransfer(strategy), timeout_s=TIMEOUT_S)

    def train(seed: int) -> None:
        assert trainer.train_step(
            pack_for_trainer(make_batch(base_model, seed=seed), trainer.config, 1)
        ).updated

    try:
        version = int((await client.weight_info())[url]["weight_version"]) + 1
        await anyio.to_thread.run_sync(train, 1)
        await barrier.update(trainer, version, "keep")
        await anyio.to_thread.run_sync(train, 2)
        chunks = []
        stream = client.generate_stream(GenerateRequest([5, 17, 42, 99, 3], LONG))
        chunks.append(await anext(stream))  # decoding on version k now
        await barrier.update(trainer, version + 1, "keep")
        chunks += [chunk async for chunk in stream]
        after = await client.generate(GenerateRequest([5, 17, 42], SamplingParams(max_tokens=4)))
    finally:
        barrier.close()
        await client.close()
    versions = {v for chunk in chunks for v in chunk.policy_versions}
    length = sum(len(chunk.token_ids) for chunk in chunks)
    return versions, length, set(after.policy_versions), version


async def test_a_request_keeps_its_adapter_version_through_a_push(tmp_path_factory, base_model):
    unmerged = make_server(tmp_path_factory, "--adapter-versions", "2")
    try:
        versions, length, after, version = await straddle(unmerged.urls[0], base_model)
    finally:
        unmerged.close()
    assert versions == {version}
    assert after == {version + 1}
    merged = make_server(tmp_path_factory)
    try:
        mixed, merged_length, _, merged_version = await straddle(merged.urls[0], base_model)
    finally:
        merged.close()
    assert mixed == {merged_version, merged_version + 1}, "the push did not land during the request"
    assert length == merged_length == LONG.max_tokens
