"""Single-turn samples of a MoE model through rollflow's own generator, and what the trainer collates from
them: the routing-replay tests run the same check against the torch engine and against vLLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rollflow.config import ModelConfig, SamplingConfig
from rollflow.inference.client import InferenceClient
from rollflow.messages import RolloutRequest, ScoredGroup
from rollflow.models.loading import create_chat_renderer, load_tokenizer
from rollflow.rollout.generator import SingleTurnGenerator
from rollflow.rollout.rewards import Rewarder
from rollflow.train.micro_batch import build_micro_batch


async def single_turn_group(
    client: InferenceClient, model_dir: Path, *, num_samples: int = 2, max_tokens: int = 8
) -> ScoredGroup:
    """One prompt's group, sampled by ``SingleTurnGenerator`` (the path of every single-turn run)."""

    async def reward(sample, item) -> float:
        return float(sample.sample_index)

    tokenizer = load_tokenizer(model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(), model_dir)
    sampling = SamplingConfig(max_tokens=max_tokens, samples_per_prompt=num_samples)
    generator = SingleTurnGenerator(client, renderer, Rewarder(reward), sampling, seed=7)
    request = RolloutRequest(
        0, [{"role": "user", "content": "route me"}], answer=None, num_samples=num_samples
    )
    return await generator.generate_group(request)


def collated_routes(group: ScoredGroup) -> torch.Tensor | None:
    """The routes the trainer's micro-batch of ``group`` holds (``MicroBatch.routed_experts``: what it
    replays)."""
    batch = build_micro_batch(group.samples, [1.0] * len(group.samples), pad_token_id=0)
    return batch.routed_experts


def assert_routes_reach_the_trainer(group: ScoredGroup, layers: int, topk: int) -> None:
    """Each sample carries one route row per token the engine ran, and the trainer's micro-batch holds
    exactly those rows (-1 past them)."""
    routes = collated_routes(group)
    assert routes is not None, "the trainer's micro-batch has no routes"
    for row, sample in enumerate(group.samples):
        tokens = len(sample.prompt_token_ids) + len(sample.completion_token_ids)
        record = sample.routed_experts
        assert record is not None, f"sample {sample.sample_index} carries no routes"
        assert record.shape in ((tokens - 1, layers, topk), (tokens, layers, topk)), record.shape
        assert torch.equal(routes[row, : len(record)], torch.as_tensor(np.array(record, dtype=np.int64)))
        assert bool((routes[row, len(record) :] == -1).all())
