"""Single-turn generation: one prompt → a scored group of ``n`` token-exact samples."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import anyio

from rollflow.config import SamplingConfig
from rollflow.inference.client import InferenceClient, generate_past_aborts
from rollflow.messages import (
    GenerateOutput,
    GenerateRequest,
    RolloutRequest,
    Sample,
    SamplingParams,
    ScoredGroup,
)
from rollflow.rollout.rewards import Rewarder
from rollflow.rollout.tasks import TaskItem


def sample_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample sampling seed that depends only on the run seed and the sample's position, so a resumed
    run samples exactly what an uninterrupted one would have."""
    digest = hashlib.blake2b(f"{run_seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


class SingleTurnGenerator:
    """Renders a chat prompt with ``renderers``, samples ``n`` completions and scores them."""

    def __init__(
        self,
        client: InferenceClient,
        renderer: Any,
        rewarder: Rewarder,
        sampling: SamplingConfig,
        seed: int,
        partial_rollouts: bool = True,
        request_prefix: str = "",
    ):
        self.client = client
        self.renderer = renderer
        self.rewarder = rewarder
        self.sampling = sampling
        self.seed = seed
        # After an abort: continue from the partial tokens (True) or sample the completion again (False).
        self.partial_rollouts = partial_rollouts
        self.stop_token_ids = tuple(renderer.get_stop_token_ids())
        # Keeps request ids unique when another generator (evaluation) shares the engines.
        self.request_prefix = request_prefix

    def render_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.renderer.render_ids(messages, add_generation_prompt=True))

    def completion_text(self, prompt_ids: list[int], completion_ids: list[int]) -> str:
        """The assistant's visible answer: the renderer strips the stop token and any thinking block."""
        parsed = self.renderer.parse_response(completion_ids, prompt_ids=prompt_ids)
        return parsed.content or ""

    async def generate_group(self, request: RolloutRequest) -> ScoredGroup:
        """Sample ``request.num_samples`` completions concurrently, then score them as one group."""
        started = time.perf_counter()
        prompt_ids = self.render_prompt(request.messages)
        outputs: list[GenerateOutput | None] = [None] * request.num_samples

        regenerated = 0

        async def sample_one(sample_index: int) -> None:
            nonlocal regenerated
            seed = sample_seed(self.seed, request.prompt_index, sample_index)
            request_id = f"{self.request_prefix}p{request.prompt_index}-s{sample_index}"

            async def attempt(so_far: GenerateOutput | None, aborts: int) -> GenerateOutput:
                partial_ids = so_far.token_ids if so_far is not None else []
                return await self._sample(prompt_ids, partial_ids, seed + aborts, request_id)

            # A weight-update barrier in abort mode ended the request: an infrastructure event, not the
            # policy's doing, so this one sample is continued or sampled again, never dropped with its group.
            output, aborts = await generate_past_aborts(
                attempt, max_tokens=self.sampling.max_tokens, partial=self.partial_rollouts
            )
            regenerated += aborts
            outputs[sample_index] = output

        async with anyio.create_task_group() as tg:
            for sample_index in range(request.num_samples):
                tg.start_soon(sample_one, sample_index)

        samples = []
        for sample_index, output in enumerate(outputs):
            assert output is not None
            samples.append(
                Sample(
                    prompt_index=request.prompt_index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    policy_versions=output.policy_versions,
                    finish_reason=output.finish_reason,
                    completion_text=self.completion_text(prompt_ids, output.token_ids),
                    kept_counts=output.kept_counts,
                )
            )
        item = TaskItem(messages=request.messages, answer=request.answer, metadata=request.metadata)
        reward_metrics = await self.rewarder.score(samples, item)
        return ScoredGroup(
            prompt_index=request.prompt_index,
            samples=samples,
            generation_time_s=time.perf_counter() - started,
            metrics={"regenerated_samples": float(regenerated), **reward_metrics},
        )

    async def _sample(
        self, prompt_ids: list[int], partial_ids: list[int], seed: int, request_id: str
    ) -> GenerateOutput:
        """Sample a completion of ``prompt_ids + partial_ids``; the output holds only the new tokens."""
        params = SamplingParams(
            max_tokens=self.sampling.max_tokens - len(partial_ids),
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
        )
        return await self.client.generate(
            GenerateRequest(prompt_token_ids=prompt_ids + partial_ids, sampling=params, request_id=request_id)
        )
