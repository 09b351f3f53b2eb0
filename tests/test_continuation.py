"""The one abort-continuation loop (``generate_past_aborts``) and the one stream assembler (``collect_stream``),
shared by single-turn generation and the TITO proxy: a pause for a weight update ends requests with their
partial tokens, and a sample continues from them (or starts over without ``partial_rollouts``)."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.errors import InferenceUnavailableError
from rollflow.inference.client import LocalInferenceClient, collect_stream, generate_past_aborts
from rollflow.messages import FinishReason, GenerateChunk, GenerateOutput, RolloutRequest

from .helpers.waits import wait_until


def output(tokens: list[int], finish: FinishReason, version: int = 0) -> GenerateOutput:
    return GenerateOutput("r", tokens, [-0.5] * len(tokens), finish, [version] * len(tokens), prompt_len=3)


class Attempts:
    """Answers attempt i with ``answers[i]`` and records what each attempt was given."""

    def __init__(self, *answers: GenerateOutput):
        self.answers = list(answers)
        self.given: list[tuple[list[int] | None, int]] = []

    async def __call__(self, so_far: GenerateOutput | None, aborts: int) -> GenerateOutput:
        self.given.append((None if so_far is None else list(so_far.token_ids), aborts))
        return self.answers[len(self.given) - 1]


async def test_an_aborted_sample_continues_from_its_partial_tokens():
    attempts = Attempts(output([1, 2], FinishReason.ABORT), output([3], FinishReason.STOP, version=1))
    joined, aborts = await generate_past_aborts(attempts, max_tokens=8)
    assert attempts.given == [(None, 0), ([1, 2], 1)]
    assert (joined.token_ids, joined.policy_versions, joined.finish_reason) == (
        [1, 2, 3],
        [0, 0, 1],
        FinishReason.STOP,
    )
    assert joined.logprobs == [-0.5] * 3 and joined.prompt_len == 3 and aborts == 1


async def test_without_partial_rollouts_a_sample_starts_over():
    attempts = Attempts(output([1, 2], FinishReason.ABORT), output([7, 8, 9], FinishReason.LENGTH, 1))
    final, aborts = await generate_past_aborts(attempts, max_tokens=3, partial=False)
    assert attempts.given == [(None, 0), (None, 1)]
    assert final.token_ids == [7, 8, 9] and final.policy_versions == [1, 1, 1] and aborts == 1


async def test_aborts_up_to_max_tokens_finish_with_length_and_max_aborts_bounds_the_loop():
    full, _ = await generate_past_aborts(
        Attempts(output([1, 2], FinishReason.ABORT), output([3], FinishReason.ABORT)), max_tokens=3
    )
    assert full.token_ids == [1, 2, 3] and full.finish_reason is FinishReason.LENGTH
    attempts = Attempts(*[output([1], FinishReason.ABORT)] * 5)
    bounded, aborts = await generate_past_aborts(attempts, max_tokens=100, max_aborts=2)
    assert len(attempts.given) == 3 and aborts == 2 and bounded.finish_reason is FinishReason.ABORT


async def chunks(*parts: tuple[list[int], FinishReason | None]):
    for tokens, finish in parts:
        yield GenerateChunk("r", tokens, [-1.0] * len(tokens), [2] * len(tokens), finish, prompt_len=4)


async def test_collect_stream_stops_where_told_and_reports_progress():
    seen = []
    stream = chunks(([1, 2], None), ([3, 4, 5], None), ([6], FinishReason.LENGTH))
    got = await collect_stream(
        stream,
        stop_at=lambda chunk: 1 if 4 in chunk.token_ids else None,
        on_tokens=lambda tokens, logprobs: seen.append(list(tokens)),
    )
    assert got.token_ids == [1, 2, 3] and got.finish_reason is FinishReason.STOP and got.prompt_len == 4
    assert seen == [[1, 2], [1, 2, 3]]
    whole = await collect_stream(chunks(([1], None), ([2], FinishReason.STOP)))
    assert whole.token_ids == [1, 2] and whole.policy_versions == [2, 2]
    with pytest.raises(InferenceUnavailableError, match="without a finish reason"):
        await collect_stream(chunks(([1], None)))


@pytest.mark.parametrize("partial_rollouts", [True, False])
async def test_single_turn_samples_survive_an_abort_pause(tiny_model_dir, partial_rollouts):
    """A real engine paused in abort mode mid-generation: every sample comes back whole, none aborted, and
    the group counts the regenerated samples."""
    from rollflow.config import ModelConfig, SamplingConfig
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import create_chat_renderer, load_tokenizer
    from rollflow.rollout.generator import SingleTurnGenerator
    from rollflow.rollout.rewards import Rewarder

    engine = TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=4, max_model_len=1024)
    client = LocalInferenceClient([engine])
    tokenizer = load_tokenizer(tiny_model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(), tiny_model_dir)
    sampling = SamplingConfig(max_tokens=600, samples_per_prompt=2)

    async def reward(sample, item):
        return 1.0

    # Seed 4: both samples run to max_tokens uninterrupted (600 tokens each), so both are in flight when the
    # pause comes; with a seed whose sample ends after a few tokens the test would race that sample's end.
    generator = SingleTurnGenerator(
        client, renderer, Rewarder(reward), sampling, seed=4, partial_rollouts=partial_rollouts
    )
    try:
        request = RolloutRequest(0, [{"role": "user", "content": "count"}], answer=None, num_samples=2)
        group = asyncio.create_task(generator.generate_group(request))
        await wait_until(lambda: engine.num_running >= 2, "both samples are running")
        # Some tokens in: the two sample together, a token each per step.
        await wait_until(
            lambda: engine.total_generated_tokens >= 2 * 3, "some tokens are sampled", poll_s=0.001
        )
        await engine.pause("abort")
        await engine.resume()
        result = await group
    finally:
        await client.close()
    assert result.metrics["regenerated_samples"] == 2
    for sample in result.samples:
        assert sample.finish_reason is not FinishReason.ABORT
        assert 0 < len(sample.completion_token_ids) <= sampling.max_tokens
        assert len(sample.logprobs) == len(sample.policy_versions) == len(sample.completion_token_ids)
