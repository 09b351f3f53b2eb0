"""Single-turn generation: one prompt → a scored group of ``n`` token-exact samples.

A prompt that cannot fit the engines' context (``PromptLimit``) is refused or skipped per
``data.on_bad_row`` before anything is generated for it, and text too long to possibly fit is refused by its
length before it is tokenized.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
import structlog

from rollflow.config import SamplingConfig
from rollflow.errors import ContextLengthExceededError, PromptTooLongError
from rollflow.inference.client import InferenceClient, generate_past_aborts
from rollflow.inference.prompt_limits import (
    OFFLOAD_CHARS,
    max_prompt_chars,
    message_text_chars,
    rendered_chars,
)
from rollflow.messages import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    RolloutRequest,
    Sample,
    SamplingParams,
    ScoredGroup,
)
from rollflow.models.special_tokens import special_token_texts, strip_special_texts
from rollflow.rollout.rewards import Rewarder
from rollflow.rollout.tasks import TaskItem

log = structlog.get_logger(__name__)

PROMPT_TOO_LONG = "prompt_too_long"
"""``mask_reason`` of the samples of a prompt skipped because it cannot fit ``inference.max_model_len``."""


def describe_request(request: RolloutRequest) -> str:
    """How messages name a prompt without a better description: its data position."""
    return f"the prompt at data position {request.prompt_index}"


class PromptLimit:
    """Whether a prompt fits the engines' context, and what to do when it does not (``data.on_bad_row``).

    A prompt fits when it leaves room for at least one generated token: at most ``max_model_len - 1``
    tokens, the engines' own rule (a server with a stricter one answers ``context_length_exceeded``, which
    the generator treats the same way). Before tokenizing, its message text is measured: more characters than
    ``max_prompt_chars(max_model_len, tokenizer)`` (``rollflow.inference.prompt_limits``: each token spells
    at most the longest vocabulary entry's characters, x4 for Unicode composition) cannot fit, so a 10 MB row
    costs a length check, not seconds of tokenizing and gigabytes of token offsets. (The converse bound, "a
    token is at least one character", only says that short text *may* fit: byte-level tokenizers spend up to
    four tokens on one character, so it cannot skip tokenizing soundly.)
    """

    def __init__(
        self,
        max_model_len: int,
        tokenizer: Any,
        *,
        on_bad_row: Literal["fail", "skip"] = "fail",
        describe: Callable[[RolloutRequest], str] = describe_request,
    ):
        """Args:
        max_model_len: ``inference.max_model_len``.
        tokenizer: the model's tokenizer (its vocabulary bounds the characters per token).
        on_bad_row: ``fail`` raises ``PromptTooLongError``; ``skip`` has the generator mask the group.
        describe: names a request's prompt in messages (a dataset's file and line).
        """
        self.max_model_len = max_model_len
        self.max_chars = max_prompt_chars(max_model_len, tokenizer)
        self.on_bad_row = on_bad_row
        self.describe = describe

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any, task: Any = None) -> PromptLimit:
        """The limit of a run (``RunConfig``): ``inference.max_model_len`` and ``data.on_bad_row``, prompts
        named by ``task.describe(metadata)`` (a dataset's file and line) where the task has it."""
        task_describe = getattr(task, "describe", None)

        def describe(request: RolloutRequest) -> str:
            return task_describe(request.metadata) if callable(task_describe) else describe_request(request)

        return cls(
            config.inference.max_model_len, tokenizer, on_bad_row=config.data.on_bad_row, describe=describe
        )

    def chars_problem(self, messages: Any) -> str | None:
        """Why ``messages`` cannot fit, judged by their length alone; None when they may."""
        chars = message_text_chars(messages)
        if chars <= self.max_chars:
            return None
        return (
            f"the prompt's text has {chars:,} characters, more than the {self.max_chars:,} that could fit "
            f"inference.max_model_len = {self.max_model_len} tokens (max_model_len x the longest token's "
            "characters x 4), so it was not tokenized"
        )

    def tokens_problem(self, num_tokens: int) -> str | None:
        """Why a rendered prompt of ``num_tokens`` tokens cannot fit; None when it fits."""
        if num_tokens <= self.max_model_len - 1:
            return None
        return (
            f"the prompt renders to {num_tokens:,} tokens, more than the {self.max_model_len - 1:,} that "
            f"inference.max_model_len = {self.max_model_len} leaves for a prompt"
        )

    def check_items(self, items: list[TaskItem]) -> int:
        """Blocking, at start-up: the items (a dataset's rows) whose text alone cannot fit, found by length
        (no tokenizing), so ``fail`` fails before training rather than when the row's turn comes. Returns
        how many there are (with ``skip``, each is skipped in its turn; one line logs them now).

        Raises:
            PromptTooLongError: the first such item, with ``on_bad_row = "fail"``.
        """
        overlong = []
        for position, item in enumerate(items):
            problem = self.chars_problem(item.messages)
            if problem is not None:
                request = RolloutRequest(
                    prompt_index=position, messages=item.messages, metadata=item.metadata
                )
                if self.on_bad_row == "fail":
                    self.refuse(request, problem)
                overlong.append(self.describe(request))
        if overlong:
            log.warning(
                "prompts that cannot fit inference.max_model_len; each is skipped in its turn",
                count=len(overlong),
                first=overlong[:3],
                max_chars=self.max_chars,
            )
        return len(overlong)

    def refuse(self, request: RolloutRequest, problem: str) -> None:
        """``on_bad_row = "fail"``: raise; ``skip``: log the skip (the caller masks the group).

        Raises:
            PromptTooLongError: with ``fail``; the message names the prompt and the fixes.
        """
        where = self.describe(request)
        if self.on_bad_row == "fail":
            raise PromptTooLongError(
                f"{where}: {problem}. Shorten or drop that row, raise inference.max_model_len, or set "
                "data.on_bad_row = 'skip' to count and skip such prompts"
            )
        log.warning(
            "prompt does not fit inference.max_model_len; skipped",
            where=where,
            row=request.metadata.get("row"),
            **({"line": request.metadata["line"]} if "line" in request.metadata else {}),
            prompt_index=request.prompt_index,
            problem=problem,
        )


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
        prompt_limit: PromptLimit | None = None,
        tokenizer: Any = None,
    ):
        """Args (besides the components and ``[sampling]``):
        partial_rollouts: ``orchestrator.partial_rollouts``.
        request_prefix: prefixes request ids (another generator may share the engines).
        prompt_limit: refuses or skips prompts that cannot fit the context (None: no check here; an engine
            that refuses one fails the group).
        tokenizer: the renderer's tokenizer; its special tokens are removed from the completion text that
            rewards see (None: the renderer's own stripping only).
        """
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
        self.prompt_limit = prompt_limit
        self._special_texts = special_token_texts(tokenizer) if tokenizer is not None else ()

    def render_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.renderer.render_ids(messages, add_generation_prompt=True))

    async def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        """``render_prompt``, in a worker thread for long text (tokenizing it would stall the event loop)."""
        if rendered_chars(messages) > OFFLOAD_CHARS:
            return await anyio.to_thread.run_sync(self.render_prompt, messages)
        return self.render_prompt(messages)

    def _skipped(self, request: RolloutRequest, problem: str, started: float) -> ScoredGroup:
        """A prompt that cannot fit: refused (``PromptTooLongError``), or a group of masked, empty samples."""
        assert self.prompt_limit is not None
        self.prompt_limit.refuse(request, problem)
        samples = [
            Sample(
                prompt_index=request.prompt_index,
                sample_index=sample_index,
                prompt_token_ids=[],
                completion_token_ids=[],
                logprobs=[],
                policy_versions=[],
                finish_reason=FinishReason.ABORT,
                masked=True,
                mask_reason=PROMPT_TOO_LONG,
            )
            for sample_index in range(request.num_samples)
        ]
        return ScoredGroup(
            prompt_index=request.prompt_index,
            samples=samples,
            generation_time_s=time.perf_counter() - started,
            metrics={"regenerated_samples": 0.0},
        )

    def completion_text(self, prompt_ids: list[int], completion_ids: list[int]) -> str:
        """The assistant's visible answer: the renderer strips the stop token and any thinking block, and
        every special token is dropped (as ``skip_special_tokens`` decoding does)."""
        parsed = self.renderer.parse_response(completion_ids, prompt_ids=prompt_ids)
        return strip_special_texts(parsed.content or "", self._special_texts)

    async def generate_group(self, request: RolloutRequest) -> ScoredGroup:
        """Sample ``request.num_samples`` completions concurrently, then score them as one group.

        A prompt that cannot fit the context (``prompt_limit``, or the engine's answer) is skipped: a group of
        masked samples without tokens (``PROMPT_TOO_LONG``).

        Raises:
            PromptTooLongError: such a prompt, with ``data.on_bad_row = "fail"``.
        """
        started = time.perf_counter()
        limit = self.prompt_limit
        if limit is not None and (problem := limit.chars_problem(request.messages)) is not None:
            return self._skipped(request, problem, started)
        prompt_ids = await self._render(request.messages)
        if limit is not None and (problem := limit.tokens_problem(len(prompt_ids))) is not None:
            return self._skipped(request, problem, started)
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

        refused: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                for sample_index in range(request.num_samples):
                    tg.start_soon(sample_one, sample_index)
        except* ContextLengthExceededError as group:
            if limit is None:
                raise
            # A server with a stricter rule than ours (vLLM counts max_tokens too) or a smaller context.
            refused = group
            while isinstance(refused, BaseExceptionGroup):
                refused = refused.exceptions[0]
        if refused is not None:
            return self._skipped(request, f"the inference server refused it ({refused})", started)

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
                    routed_experts=output.routed_experts,
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
