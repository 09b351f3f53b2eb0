"""TorchEngine on a mixture-of-experts model: the Qwen3-MoE forward against Hugging Face, and routed experts.

Routes are checked against the HF model's own router: a full forward with ``output_router_logits`` and the
top-k of its softmax, on the same tokens. Like ``test_engine.py``, the model is a copy with re-drawn, larger
weights so greedy continuations vary token to token.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.errors import EngineError
from rollflow.inference.engine import TorchEngine
from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest, SamplingParams

from .helpers.waits import wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def moe_model(tiny_moe_model_dir):
    """The tiny MoE model with every matrix and expert tensor re-drawn at std 0.3 (seeded)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3, generator=generator)
    return model


@pytest.fixture
async def engine(moe_model):
    engine = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=4, max_model_len=256, return_routed_experts=True
    )
    yield engine
    await engine.shutdown()


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def hf_forward(model, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits [tokens, vocab] and router top-k [tokens, layers, topk] of one full HF forward."""
    with torch.no_grad():
        result = model(torch.tensor([tokens]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    routes = [
        torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices
        for logits in result.router_logits
    ]
    return result.logits[0], torch.stack(routes, dim=1).numpy()


def check_against_hf(model, prompt: list[int], output: GenerateOutput, temperature: float = 1.0) -> float:
    """Assert the routes are HF's router choices; return the largest logprob difference from HF's forward."""
    logits, routes = hf_forward(model, prompt + output.token_ids)
    # One row per token the engine ran: the prompt, and every sampled token but the last.
    assert output.routed_experts.shape == (len(prompt) + len(output.token_ids) - 1, 2, 2)
    np.testing.assert_array_equal(output.routed_experts, routes[:-1])
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    expected = torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
    return max(abs(a - b) for a, b in zip(output.logprobs, expected.tolist(), strict=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_moe_logprobs_and_routes_match_hf_in_a_padded_batch(engine, moe_model, temperature):
    prompts = make_prompts([5, 23, 1, 12], seed=0)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=7)
    outputs = await asyncio.gather(*(engine.generate(GenerateRequest(p, params)) for p in prompts))
    diffs = [check_against_hf(moe_model, p, o, temperature) for p, o in zip(prompts, outputs, strict=True)]
    assert max(diffs) < 1e-4
    assert all(o.routed_experts.dtype == np.uint8 for o in outputs)
    # The routes are real: different tokens go to different experts.
    assert len({tuple(row) for o in outputs for row in o.routed_experts[:, 0]}) > 1


async def test_greedy_moe_matches_hf_generate(engine, moe_model):
    prompt = make_prompts([9], seed=1)[0]
    output = await engine.generate(GenerateRequest(prompt, GREEDY))
    with torch.no_grad():
        generated = moe_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert output.token_ids == generated[0, len(prompt) :].tolist()
    assert len(set(output.token_ids)) > 1


async def test_prefix_hit_returns_the_same_routes_as_a_miss(engine, moe_model):
    """Multi-turn shape: the second turn's prompt extends the first turn's prompt and completion, so the cached
    prefix's routes come from the prefix cache; they equal those of an engine without prefix caching and HF's."""
    uncached = TorchEngine(
        copy.deepcopy(moe_model),
        max_batch_size=4,
        max_model_len=256,
        enable_prefix_caching=False,
        return_routed_experts=True,
    )
    try:
        histories = make_prompts([8, 15], seed=3)
        for turn in range(3):
            outputs = await asyncio.gather(*(engine.generate(GenerateRequest(h, GREEDY)) for h in histories))
            expected = await asyncio.gather(
                *(uncached.generate(GenerateRequest(h, GREEDY)) for h in histories)
            )
            for history, output, reference in zip(histories, outputs, expected, strict=True):
                assert output.token_ids == reference.token_ids, f"turn {turn}"
                np.testing.assert_array_equal(output.routed_experts, reference.routed_experts)
                assert check_against_hf(moe_model, history, output) < 1e-4
            user_turns = make_prompts([3, 5], seed=10 + turn)
            histories = [h + o.token_ids + u for h, o, u in zip(histories, outputs, user_turns, strict=True)]
        assert engine.prefix_cache_hits == 4
        # The identical prompt again: all but its last token's routes come from the cache.
        again = await engine.generate(GenerateRequest(histories[0], GREEDY))
        first = await uncached.generate(GenerateRequest(histories[0], GREEDY))
        assert engine.prefix_cache_hits == 5
        np.testing.assert_array_equal(again.routed_experts, first.routed_experts)
    finally:
        await uncached.shutdown()


async def test_samples_sharing_a_prompt_get_its_routes(engine, moe_model):
    """Three seeded samples of one prompt admitted in one step: the two that copy the first one's keys and
    values get its prompt routes, and every output's routes and logprobs are HF's."""
    prompt = make_prompts([12], seed=8)[0]
    requests = [
        GenerateRequest(
            prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=seed), request_id=f"s{seed}"
        )
        for seed in range(3)
    ]
    await engine.pause("keep")
    tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
    await wait_until(lambda: engine.num_waiting == 3, "the samples queue")
    await engine.resume()
    outputs = await asyncio.gather(*tasks)
    assert engine.shared_prompt_tokens == 2 * (len(prompt) - 1)
    for output in outputs:
        assert check_against_hf(moe_model, prompt, output) < 1e-4


async def test_routes_are_dropped_with_the_prefix_cache(engine, moe_model):
    prompt = make_prompts([12], seed=4)[0]
    await engine.generate(GenerateRequest(prompt, GREEDY))
    await engine.reset_prefix_cache()
    assert not engine._cached_routes
    output = await engine.generate(GenerateRequest(prompt, GREEDY))
    assert engine.prefix_cache_hits == 0
    assert check_against_hf(moe_model, prompt, output) < 1e-4


async def test_aborted_requests_keep_their_routes(engine):
    prompt = make_prompts([6], seed=5)[0]
    task = asyncio.create_task(engine.generate(GenerateRequest(prompt, SamplingParams(max_tokens=240))))
    await wait_until(lambda: engine.total_generated_tokens >= 5, "some tokens are sampled", poll_s=0.001)
    await engine.pause("keep")
    queued = asyncio.create_task(engine.generate(GenerateRequest(prompt, GREEDY)))
    await wait_until(lambda: engine.num_waiting == 1, "the second request queues")
    assert await engine.abort() == 2
    partial, never_admitted = await asyncio.wait_for(asyncio.gather(task, queued), 60)
    assert partial.finish_reason == never_admitted.finish_reason == FinishReason.ABORT
    assert 0 < len(partial.token_ids) < 240
    assert partial.routed_experts.shape[0] == len(prompt) + len(partial.token_ids) - 1
    # A request aborted before it ran has no routes.
    assert never_admitted.token_ids == [] and never_admitted.routed_experts is None
    await engine.resume()


async def test_routes_are_off_by_default_and_need_a_moe_model(moe_model, tiny_model_dir):
    engine = TorchEngine(copy.deepcopy(moe_model), max_batch_size=1, max_model_len=64)
    try:
        output = await engine.generate(GenerateRequest([5, 6, 7], GREEDY))
        assert output.routed_experts is None and engine.runner.last_routed_experts is None
    finally:
        await engine.shutdown()
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(
        EngineError,
        match="routed experts needs a mixture-of-experts model.*'qwen3'.*inference.return_routed_experts",
    ):
        TorchEngine(dense, max_batch_size=1, max_model_len=64, return_routed_experts=True)


def test_an_unfused_experts_layout_is_a_clear_error(moe_model):
    """Older transformers kept experts as a list of MLP modules; the runner reads the fused 3-D weights."""
    model = copy.deepcopy(moe_model)
    model.model.layers[1].mlp.experts = torch.nn.ModuleList()
    with pytest.raises(EngineError, match="fused-experts layout.*upgrade transformers"):
        TorchEngine(model, max_batch_size=1, max_model_len=64)
