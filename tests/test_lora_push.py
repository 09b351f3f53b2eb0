"""Adapter-only weight pushes from a ``[trainer.lora]`` trainer into real ``rollflow serve`` servers (broadcast
over gloo, checkpoint over HTTP): the servers decode as the merged model does, hold the adapter as sent, and a
planted stale adapter is stopped by proof of delivery."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rollflow.config import LoraConfig, TrainerConfig
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer
from rollflow.weights import WeightTransfer, WeightTransferError, create_strategy

from .helpers.training import make_batch
from .helpers.weights import GREEDY, PROMPTS, server_outputs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.http_only(reason="adapter pushes into private servers"),
]

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from .helpers.servers import BackgroundServerGroup

    group = BackgroundServerGroup(2, tmp_path_factory.mktemp("lora-servers"))
    yield group
    group.close()


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def lora_trainer(base_model) -> Trainer:
    # A large learning rate: a few steps move greedy decoding.
    return Trainer(copy.deepcopy(base_model), TrainerConfig(lr=0.05, lora=LoraConfig(rank=4, alpha=8.0)))


def train(trainer: Trainer, base_model, seed: int) -> None:
    batch = pack_for_trainer(make_batch(base_model, seed=seed), trainer.config, 1)
    assert trainer.train_step(batch).updated


@torch.no_grad()
def argmax_continuations(trainer: Trainer) -> list[list[int]]:
    """Greedy continuations by argmax over the trainer's own (adapted) model: the reference for the servers."""
    outputs = []
    model = trainer.model.eval()
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        outputs.append(ids[len(prompt) :])
    model.train()
    return outputs


async def test_adapter_pushes_reach_every_server_merged(servers, base_model):
    import anyio

    trainer = lora_trainer(base_model)
    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    strategies = [
        create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S),
        create_strategy("checkpoint", timeout_s=TIMEOUT_S),
    ]
    try:
        base = int((await client.weight_info())[servers.urls[0]]["weight_version"])
        for offset, strategy in enumerate(strategies, start=1):
            before, _ = await server_outputs(servers.urls[0])
            for seed in range(3):
                await anyio.to_thread.run_sync(train, trainer, base_model, 10 * offset + seed)
            version = base + offset
            barrier = WeightBarrier(client, WeightTransfer(strategy), timeout_s=TIMEOUT_S)
            try:
                await barrier.update(trainer, version, "keep")
            finally:
                barrier.close()
            expected = argmax_continuations(trainer)
            assert expected != before, strategy.name
            for url in servers.urls:
                outputs, versions = await server_outputs(url)
                assert outputs == expected, (strategy.name, url)
                assert versions == {version}
            held = await client.control.weight_checksums()
            assert all(set(names) == {n for n, _ in trainer.named_weights()} for names in held.values())
    finally:
        await client.close()


@dataclass
class StaleAdapterFile:
    """The planted fault: a trainer handle whose checkpoint pushes are overwritten, after rank 0 wrote them
    (and took their digests), by the adapter of its first push: what a stale shared filesystem serves."""

    trainer: Trainer
    first: bytes | None = None

    @property
    def world_size(self) -> int:
        return 1

    def named_weights(self) -> Any:
        return self.trainer.named_weights()

    def push_weights(self, call: Any) -> Any:
        result = self.trainer.push_weights(call)
        if call.op == "push":
            if self.first is None:
                with open(result["path"], "rb") as file:
                    self.first = file.read()
            else:
                with open(result["path"], "wb") as file:
                    file.write(self.first)
        return result


async def test_a_stale_adapter_on_the_servers_fails_the_push(servers, base_model, tmp_path):
    import anyio

    trainer = lora_trainer(base_model)
    handle = StaleAdapterFile(trainer)
    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    strategy = create_strategy("checkpoint", checkpoint_dir=tmp_path / "shared", timeout_s=TIMEOUT_S)
    barrier = WeightBarrier(client, WeightTransfer(strategy), timeout_s=TIMEOUT_S)
    try:
        version = int((await client.weight_info())[servers.urls[0]]["weight_version"]) + 1
        await anyio.to_thread.run_sync(train, trainer, base_model, 50)
        await barrier.update(handle, version, "keep")  # the first push arrives whole
        await anyio.to_thread.run_sync(train, trainer, base_model, 51)
        with pytest.raises(WeightTransferError, match=r"lora_[AB]\.weight with another digest") as error:
            await barrier.update(handle, version + 1, "keep")
        assert all(url in str(error.value) for url in servers.urls)  # after the barrier's one retry, too
    finally:
        barrier.close()
        await client.close()
