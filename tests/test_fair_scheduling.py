"""Fair scheduling in ``TorchEngine`` (issue 30, item 3): one request's many sequences do not hold every batch
slot ahead of a later request.

Fairness is checked in engine steps, never by wall-clock thresholds: a short request that arrives while a
large one fills the batch finishes within a few steps of its arrival, long before the large one does. The
sequences preempted for it keep their tokens, and finish exactly as they would have without the preemption.
"""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams
from rollflow.models.loading import load_tokenizer

from .helpers.waits import wait_until

# Slots of the engines below; the hog asks for twice as many sequences.
SLOTS = 4
HOG_TOKENS = 120
SHORT_TOKENS = 4
# Steps a short request may take once posted: one for its message to be taken (a step may be running when it
# arrives), one for admission (prefill and decode: two tokens), then a step per further token, plus slack.
SHORT_STEPS = SHORT_TOKENS + 4


class RecordingEngine(TorchEngine):
    """A ``TorchEngine`` that records, on its own thread, the step at which each request id first finished a
    sequence, so fairness is read in engine steps whatever the event loop's delays."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished_at: dict[str, int] = {}

    def _finish(self, slot, reason):
        self.finished_at.setdefault(self._slots[slot].request.request_id, self.num_steps)
        super()._finish(slot, reason)


def varied(model):
    """A copy with matrices re-drawn at std 0.3 (seeded): greedy continuations vary token to token."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3, generator=generator)
    return model


@pytest.fixture(scope="module")
def dense_model(tiny_model_dir):
    return varied(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def moe_model(tiny_moe_model_dir):
    return varied(AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval())


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def run_hog_and_short(engine: RecordingEngine, hog_prompts: list[list[int]], short_prompt: list[int]):
    """Start a hog of ``2 * SLOTS`` sequences under one request id; once it holds every slot, send a short
    request. Returns (hog outputs, short output, engine steps from sending the short request to its end,
    whether a hog sequence had ended before it)."""
    hog = asyncio.gather(
        *(engine.generate(GenerateRequest(p, greedy(HOG_TOKENS), request_id="hog")) for p in hog_prompts)
    )
    await wait_until(
        lambda: engine.num_running == SLOTS and engine.total_generated_tokens >= SLOTS * 3,
        "the hog holds every slot and has decoded",
        poll_s=0.001,
    )
    steps_before = engine.num_steps
    short = await engine.generate(GenerateRequest(short_prompt, greedy(SHORT_TOKENS), request_id="short"))
    outputs = await hog
    steps = engine.finished_at["short"] - steps_before
    return outputs, short, steps, engine.finished_at["hog"] < engine.finished_at["short"]


async def test_a_short_request_is_not_queued_behind_a_hog(dense_model):
    hog_prompts = prompts([5, 9, 7, 12, 6, 10, 8, 11], seed=1)
    [short_prompt] = prompts([6], seed=2)
    alone = TorchEngine(copy.deepcopy(dense_model), max_batch_size=1, max_model_len=256)
    engine = RecordingEngine(copy.deepcopy(dense_model), max_batch_size=SLOTS, max_model_len=256)
    try:
        expected = [await alone.generate(GenerateRequest(p, greedy(HOG_TOKENS))) for p in hog_prompts]
        hog, short, steps, hog_ended_first = await run_hog_and_short(engine, hog_prompts, short_prompt)
    finally:
        await alone.shutdown()
        await engine.shutdown()
    # Strict first-come order would have kept it waiting for HOG_TOKENS steps (until a hog sequence ended).
    assert steps <= SHORT_STEPS, f"the short request took {steps} engine steps behind the hog"
    assert not hog_ended_first
    assert len(short.token_ids) == SHORT_TOKENS and short.finish_reason == FinishReason.LENGTH
    assert engine.num_preemptions >= 1
    # The preempted hog sequence resumed from its tokens: every hog output is what it is without a neighbour.
    for output, reference in zip(hog, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        assert output.finish_reason == FinishReason.LENGTH


async def test_requests_share_the_batch_and_one_sequence_requests_keep_arrival_order(dense_model):
    engine = TorchEngine(copy.deepcopy(dense_model), max_batch_size=SLOTS, max_model_len=256)
    try:
        await engine.pause("keep")
        # Two requests of 2 * SLOTS sequences each, queued together: each gets half of the batch.
        tasks = [
            asyncio.ensure_future(engine.generate(GenerateRequest(p, greedy(40), request_id=name)))
            for name in ("a", "b")
            for p in prompts([4] * (2 * SLOTS), seed=3)
        ]
        await wait_until(lambda: engine.num_waiting == 4 * SLOTS, "every sequence waits", poll_s=0.001)
        await engine.resume()
        await wait_until(lambda: engine.num_running == SLOTS, "every slot runs", poll_s=0.001)
        assert sorted(engine._running_per_group.values()) == [SLOTS // 2, SLOTS // 2]
        await asyncio.gather(*tasks)
        # One-sequence requests (no shared id) never preempt each other.
        preemptions = engine.num_preemptions
        await engine.pause("keep")
        singles = [
            asyncio.ensure_future(engine.generate(GenerateRequest(p, greedy(1 + (i % 3)))))
            for i, p in enumerate(prompts([5] * 12, seed=4))
        ]
        await wait_until(lambda: engine.num_waiting == 12, "12 sequences wait", poll_s=0.001)
        await engine.resume()
        await asyncio.gather(*singles)
        assert engine.num_preemptions == preemptions
    finally:
        await engine.shutdown()


async def test_a_preempted_moe_sequence_keeps_one_route_per_token(moe_model):
    hog_prompts = prompts([5, 9, 7, 12, 6, 10, 8, 11], seed=5)
    [short_prompt] = prompts([6], seed=6)
    alone = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=1, max_model_len=256, return_routed_experts=True
    )
    engine = RecordingEngine(
        copy.deepcopy(moe_model), max_batch_size=SLOTS, max_model_len=256, return_routed_experts=True
    )
    try:
        expected = [await alone.generate(GenerateRequest(p, greedy(HOG_TOKENS))) for p in hog_prompts]
        hog, short, steps, _ = await run_hog_and_short(engine, hog_prompts, short_prompt)
    finally:
        await alone.shutdown()
        await engine.shutdown()
    assert steps <= SHORT_STEPS and engine.num_preemptions >= 1
    for output, reference, prompt in zip(hog, expected, hog_prompts, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.routed_experts.shape[0] == len(prompt) + len(output.token_ids) - 1
        np.testing.assert_array_equal(output.routed_experts, reference.routed_experts)
    assert short.routed_experts.shape[0] == len(short_prompt) + SHORT_TOKENS - 1


async def test_a_short_http_request_finishes_while_a_hog_request_runs(dense_model, tiny_model_dir):
    """The same through ``rollflow serve``: one ``/v1/completions`` of 2 prompts x n = SLOTS, then a short one."""
    engine = RecordingEngine(copy.deepcopy(dense_model), max_batch_size=SLOTS, max_model_len=512)
    server = EngineServer(engine, load_tokenizer(tiny_model_dir), served_model_name="tiny", eos_token_ids=())
    await server.start()
    hog_body = {
        "prompt": prompts([6, 8], seed=7),
        "n": SLOTS,
        "max_tokens": 400,
        "temperature": 0.0,
        "request_id": "hog",
    }
    try:
        async with aiohttp.ClientSession() as http:
            hog = asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=hog_body))
            await wait_until(
                lambda: engine.num_running == SLOTS and engine.total_generated_tokens >= SLOTS * 3,
                "the hog holds every slot and has decoded",
                poll_s=0.001,
            )
            steps_before = engine.num_steps
            body = {
                "prompt": prompts([5], seed=8)[0],
                "max_tokens": SHORT_TOKENS,
                "temperature": 0.0,
                "request_id": "short",
            }
            async with http.post(f"{server.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            steps = engine.finished_at["short"] - steps_before
            assert "hog" not in engine.finished_at  # no hog sequence has ended
            hog.cancel()  # the client leaves: its sequences are aborted
            with pytest.raises(asyncio.CancelledError):
                await hog
    finally:
        await server.close()
    assert answer["choices"][0]["finish_reason"] == "length"
    # First come, first served, it would have waited for the hog's first sequences (400 steps) and then for
    # the rest of its sequences; reading and parsing its HTTP request adds a few steps, not hundreds.
    assert steps < 400, f"the short request took {steps} engine steps behind the hog"


class CapRecordingEngine(RecordingEngine):
    """Records, after each step, the slots the hog held while the short request ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hog_slots_beside_short: list[int] = []
        self.most_running = 0

    def _step(self):
        super()._step()
        self.most_running = max(self.most_running, self._num_running)
        if "short" in self._running_per_group:
            self.hog_slots_beside_short.append(self._running_per_group.get("hog", 0))


@pytest.mark.parametrize("share", [None, 0.25])
async def test_latency_first_caps_a_hog_while_another_request_runs_and_lifts_it_after(dense_model, share):
    """``max_request_share``: while the short request runs, the hog holds at most its cap (2 of 8 slots, the
    rest preempted and left free), every hog sequence still finishes exactly as alone, and with the short
    request gone the hog takes every slot again. Without it (None), the hog keeps all slots but the one the
    short request took."""
    slots, cap = 2 * SLOTS, 2
    hog_prompts = prompts([5, 9, 7, 12, 6, 10, 8, 11] * 2, seed=3)
    [short_prompt] = prompts([6], seed=4)
    alone = TorchEngine(copy.deepcopy(dense_model), max_batch_size=1, max_model_len=256)
    engine = CapRecordingEngine(
        copy.deepcopy(dense_model), max_batch_size=slots, max_model_len=256, max_request_share=share
    )
    try:
        expected = [await alone.generate(GenerateRequest(p, greedy(HOG_TOKENS))) for p in hog_prompts]
        hog = asyncio.gather(
            *(engine.generate(GenerateRequest(p, greedy(HOG_TOKENS), request_id="hog")) for p in hog_prompts)
        )
        await wait_until(lambda: engine.num_running == slots, "the hog holds every slot", poll_s=0.001)
        short = await engine.generate(GenerateRequest(short_prompt, greedy(SHORT_TOKENS), request_id="short"))
        engine.most_running = 0
        outputs = await hog
    finally:
        await alone.shutdown()
        await engine.shutdown()
    assert len(short.token_ids) == SHORT_TOKENS
    beside = engine.hog_slots_beside_short
    assert beside, "no step ran with the short request in the engine"
    if share is None:
        assert max(beside) == slots - 1
    else:
        assert engine.request_slot_cap == cap
        assert max(beside) <= cap, f"the hog held {beside} slots beside the short request"
        assert engine.num_preemptions >= slots - 1 - cap
    assert engine.most_running == slots, "the hog did not take every slot again once alone"
    for output, reference in zip(outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-4)


async def test_latency_first_never_caps_requests_of_one_sequence(dense_model):
    """A training run's traffic (one sequence per request) fills every slot under the cap."""
    engine = CapRecordingEngine(
        copy.deepcopy(dense_model), max_batch_size=SLOTS, max_model_len=256, max_request_share=0.25
    )
    try:
        await asyncio.gather(
            *(engine.generate(GenerateRequest(p, greedy(8))) for p in prompts([5] * (2 * SLOTS), seed=5))
        )
    finally:
        await engine.shutdown()
    assert engine.most_running == SLOTS
    assert engine.num_preemptions == 0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_max_request_share_out_of_range_is_refused(dense_model, share):
    with pytest.raises(ValueError, match="max_request_share must be in"):
        TorchEngine(dense_model, max_batch_size=SLOTS, max_model_len=64, max_request_share=share)
