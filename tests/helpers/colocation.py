"""Colocation checks: a server pushed a saved copy of its weights, control calls, the control log by step."""

from __future__ import annotations

import json

import aiohttp
import torch

from ..conftest import REPO_ROOT

QUICKSTART = REPO_ROOT / "examples" / "quickstart.toml"
GENERATE = {"token_ids": [5, 17, 300], "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 11}}


class StateDictReceiver:
    """A weight receiver that hands over a saved copy of the model's weights (``update_info`` is ignored)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def receive(self, update_info: dict) -> list[tuple[str, torch.Tensor]]:
        return list(self.weights.items())

    def close(self) -> None:
        pass


async def call(server, method: str, path: str, body=None) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, server.url + path, json=body) as response,
    ):
        text = await response.text()
        return response.status, (json.loads(text) if text else {})


async def generate(server) -> tuple[int, dict]:
    return await call(server, "POST", "/inference/v1/generate", GENERATE)


async def control_logs(urls: list[str]) -> list[list[dict]]:
    async with aiohttp.ClientSession() as http:
        logs = []
        for url in urls:
            async with http.get(f"{url}/control_log") as response:
                logs.append((await response.json())["entries"])
        return logs


def step_cycles(entries: list[dict]) -> list[list[dict]]:
    """The control log cut at each sleep: one cycle per training step (the set-up push comes before)."""
    cycles: list[list[dict]] = []
    for entry in entries:
        if entry["event"] == "sleep":
            cycles.append([])
        if cycles:
            cycles[-1].append(entry)
    return cycles


def check_cycle(cycle: list[dict], level: int, version: int) -> None:
    """sleep ▸ wake weights ▸ push (pause, update, finish, resume) ▸ wake kv_cache, nothing generated while
    asleep."""
    events = [entry["event"] for entry in cycle]
    assert events[0] == "sleep" and cycle[0]["level"] == level
    assert events[1] == "wake_up" and cycle[1]["tags"] == ["weights"] and not cycle[1]["awake"]
    push = events[2:-1]
    assert push[0] == "pause" and push[-1] == "resume"
    assert "update_weights" in push and push[-2] == "finish_weight_update"
    assert events[-1] == "wake_up" and cycle[-1]["tags"] == ["kv_cache"] and cycle[-1]["awake"]
    assert cycle[-1]["policy_version"] == version
    # Between the sleep and the KV cache's wake-up this server generated nothing.
    assert cycle[-1]["tokens_generated"] == cycle[0]["tokens_generated"]
