"""The gloo broadcast into vLLM servers, without a vLLM: the payloads carry only the plugin engine's keys, the
plugin's receiver (``rollflow.vllm_plugin.gloo``, torch-only, so it runs here) takes a real gloo broadcast from
rollflow's trainer side, and proof of delivery fails a push whose tensors differ. The fake control plane
stands in for vLLM's HTTP routes only (the receiver, the group and the trainer side are real); the same path
against a real vLLM: ``tests/test_vllm_broadcast.py``."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import torch

from rollflow.errors import WeightTransferError
from rollflow.vllm_plugin.gloo import GlooReceiver
from rollflow.vllm_plugin.gloo import plan_buckets as plugin_plan_buckets
from rollflow.weights import StaticWeights, WeightTransfer, create_strategy
from rollflow.weights.packing import plan_buckets, specs_of

from .helpers.weights import fake_world

# The fields of rollflow/vllm_plugin/engine.py's dataclasses; vLLM refuses any other key.
ENGINE_INIT_KEYS = {
    "backend",
    "timeout_s",
    "master_address",
    "master_port",
    "world_size",
    "rank_offset",
    "packed",
    "packed_buffer_size_bytes",
    "group_name",
}
ENGINE_UPDATE_KEYS = {"path", "url", "policy_version", "names", "dtype_names", "shapes"}


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(6, 4, generator=generator)),
        ("model.layers.0.input_layernorm.weight", torch.linspace(0.5, 1.5, 4)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=generator)),
        ("model.norm.weight", torch.linspace(0.9, 1.1, 4).to(torch.bfloat16)),
    ]


def _digest(tensor: torch.Tensor) -> str:
    """vLLM's ``/weight_checker`` checksum: SHA-256 of the parameter's bytes."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class PluginServers:
    """``num_servers`` one-worker vLLM servers as the control plane sees them, each receiving through the
    plugin's real ``GlooReceiver`` (in a thread, as vLLM's worker would); ``corrupt`` names a tensor one
    server's checksum reports changed."""

    def __init__(self, num_servers: int, corrupt: str | None = None):
        self.server_urls = [f"http://vllm{i}:8000" for i in range(num_servers)]
        self.corrupt = corrupt
        self.init_infos: list[dict[str, Any]] = []
        self.update_infos: list[dict[str, Any]] = []
        self.receivers: list[GlooReceiver] = []
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in self.server_urls]
        self.versions: dict[str, str | None] = dict.fromkeys(self.server_urls)

    async def world_size(self):
        return fake_world(len(self.server_urls), self.server_urls)

    async def init_weight_transfer(self, init_infos):
        self.init_infos.extend(init_infos)

        def join(info: dict[str, Any]) -> GlooReceiver:
            return GlooReceiver(
                master_address=info["master_address"],
                master_port=info["master_port"],
                world_size=info["world_size"],
                rank=info["rank_offset"],
                group_name=info["group_name"],
                bucket_size_bytes=info["packed_buffer_size_bytes"],
                timeout_s=info["timeout_s"],
            )

        self.receivers = list(await asyncio.gather(*(asyncio.to_thread(join, info) for info in init_infos)))

    async def start_weight_update(self):
        pass

    async def update_weights(self, update_info):
        self.update_infos.append(dict(update_info))
        spec = (update_info["names"], update_info["dtype_names"], update_info["shapes"])
        received = await asyncio.gather(*(asyncio.to_thread(r.receive, *spec) for r in self.receivers))
        self.loaded = [dict(named) for named in received]

    async def finish_weight_update(self, policy_version=None):
        self.versions = dict.fromkeys(self.server_urls, str(policy_version))

    async def weight_versions(self):
        return dict(self.versions)

    async def weight_checksums(self):
        answers = {}
        for index, (url, loaded) in enumerate(zip(self.server_urls, self.loaded, strict=True)):
            answers[url] = {
                name: {_digest(tensor + 1 if index == 1 and name == self.corrupt else tensor)}
                for name, tensor in loaded.items()
            }
        return answers

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


def test_the_plugin_plans_the_same_buckets_as_rollflow() -> None:
    generator = torch.Generator().manual_seed(3)
    specs = specs_of(
        (f"w{i}", torch.empty(int(n), dtype=torch.float16))
        for i, n in enumerate(torch.randint(1, 300, (40,), generator=generator))
    )
    for bucket_size in (1, 100, 512, 4096, 10**9):
        assert plugin_plan_buckets([s.nbytes for s in specs], bucket_size) == plan_buckets(specs, bucket_size)


async def test_a_gloo_push_into_vllm_servers_reaches_the_plugin_receiver_with_only_its_keys() -> None:
    servers = PluginServers(2)
    transfer = WeightTransfer(
        create_strategy("broadcast", engine="vllm", backend="gloo", bucket_size_mb=64 / 2**20, timeout_s=60)
    )
    try:
        for version in (3, 4):
            await transfer.push(servers, StaticWeights(_weights), policy_version=version)
        assert transfer.delivery_check_s > 0  # what the barrier reports as delivery_check_time_s
    finally:
        transfer.close()
        servers.close()
    assert [info["rank_offset"] for info in servers.init_infos] == [1, 2]
    assert all(set(info) == ENGINE_INIT_KEYS and info["backend"] == "gloo" for info in servers.init_infos)
    assert all(set(update) <= ENGINE_UPDATE_KEYS for update in servers.update_infos)
    for loaded in servers.loaded:
        assert list(loaded) == [name for name, _ in _weights()]
        assert all(torch.equal(loaded[name], tensor) for name, tensor in _weights())
    assert servers.versions == dict.fromkeys(servers.server_urls, "4")


async def test_a_vllm_server_holding_another_tensor_after_a_gloo_push_fails_it_naming_both() -> None:
    servers = PluginServers(2, corrupt="model.norm.weight")
    transfer = WeightTransfer(create_strategy("broadcast", engine="vllm", backend="gloo", timeout_s=60))
    try:
        with pytest.raises(
            WeightTransferError,
            match=r"policy version 5, but http://vllm1:8000 holds model.norm.weight with another digest",
        ) as caught:
            await transfer.push(servers, StaticWeights(_weights), policy_version=5)
        assert "vllm0" not in str(caught.value)
        assert transfer.sender is None  # the next push reconnects
    finally:
        transfer.close()
        servers.close()


def test_the_plugin_receiver_refuses_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match="rank 3 is outside 1..2"):
        GlooReceiver(
            master_address="127.0.0.1",
            master_port=1,
            world_size=3,
            rank=3,
            group_name="g",
            bucket_size_bytes=1,
            timeout_s=1,
        )
