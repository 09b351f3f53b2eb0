"""Weight-transfer stand-ins and checks: thread receivers as servers, weights compared, servers' outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from rollflow.inference.control import WorldSize
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.weights.server.receiver import create_receiver

PROMPTS = [[5, 17, 42, 99, 3], [300, 2, 2, 7], [1000, 64, 8, 128, 11, 12]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def assert_same_weights(
    expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]
) -> None:
    got_by_name = dict(got)
    assert sorted(got_by_name) == sorted(name for name, _ in expected)
    for name, tensor in expected:
        assert got_by_name[name].dtype == tensor.dtype, name
        assert torch.equal(got_by_name[name], tensor), name


class ThreadClient:
    """In-process stand-in for the servers: receivers run in threads. ``hang_update`` makes the servers accept
    ``/update_weights`` and then never receive (a hung peer)."""

    def __init__(self, num_servers: int, *, join: bool = True, hang_update: bool = False):
        self.num_servers = num_servers
        self.join = join
        self.hang_update = hang_update
        self.receivers: list[Any] = []
        self.received: list[list[tuple[str, torch.Tensor]]] = []

    @property
    def server_urls(self) -> list[str]:
        return [f"fake://server{i}" for i in range(self.num_servers)]

    async def world_size(self) -> WorldSize:
        return fake_world(self.num_servers, self.server_urls)

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        if not self.join:
            await asyncio.sleep(3600)
        payloads = init_info if isinstance(init_info, list) else [init_info] * self.num_servers
        self.receivers = list(
            await asyncio.gather(*[asyncio.to_thread(create_receiver, p, 0) for p in payloads])
        )

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.hang_update:
            await asyncio.sleep(3600)
        self.received = list(
            await asyncio.gather(*[asyncio.to_thread(r.receive, update_info) for r in self.receivers])
        )

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        pass

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


async def server_outputs(url: str) -> tuple[list[list[int]], set[int]]:
    client = RemoteInferenceClient(url, control_timeout_s=60)
    try:
        outputs = [await client.generate(GenerateRequest(list(p), GREEDY)) for p in PROMPTS]
    finally:
        await client.close()
    return [o.token_ids for o in outputs], {v for o in outputs for v in o.policy_versions}


def fake_world(total_workers: int, server_urls: Sequence[str]) -> WorldSize:
    """The world size a fake control plane reports: one worker per server (or ``total_workers`` in one)."""
    servers = max(1, len(server_urls))
    return WorldSize(
        total_workers=total_workers,
        workers_per_server=max(1, total_workers // servers),
        num_servers=servers,
        server_urls=tuple(server_urls),
    )
