"""The ``InferenceClient`` protocol: the one way the rest of rollflow talks to inference engines.

``LocalInferenceClient`` drives torch engines in this process. The HTTP client (``RemoteInferenceClient``)
implements the same protocol, so generators, the TITO proxy and the orchestrator never know which one
they hold. This module must not import torch at module scope.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from rollflow.errors import InferenceUnavailableError
from rollflow.inference.control import PAUSE_MODES, ControlPlane, InProcessControlPlane, PauseMode
from rollflow.messages import FinishReason, GenerateChunk, GenerateOutput, GenerateRequest, join_kept_counts

if TYPE_CHECKING:
    from rollflow.inference.engine.engine import TorchEngine

__all__ = ["PAUSE_MODES", "InferenceClient", "LocalInferenceClient", "LogprobsMode", "PauseMode"]

# vLLM's ``--logprobs-mode`` values a torch engine serves: ``processed_logprobs`` (after temperature and
# top-k/top-p, what the trainer recomputes) and ``raw_logprobs`` (vLLM's default, before both).
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


@runtime_checkable
class InferenceClient(Protocol):
    """Generation and control of one or more inference engines.

    Pause modes follow vLLM: ``abort`` ends in-flight requests with finish reason ``abort`` and their
    partial tokens; ``wait`` lets them finish; ``keep`` freezes them and continues them after ``resume``.
    While paused, new ``generate`` calls wait for ``resume`` (HTTP servers answer 503 instead).

    Everything besides generation (sleep, world size, the weight-update lifecycle) is the client's
    ``control`` plane (``rollflow.inference.control.ControlPlane``), which the weight barrier, colocation and
    the strategies in ``rollflow.weights`` drive; ``pause``, ``resume`` and ``get_world_size`` here are
    shorthands of it.
    """

    #: The engines' control plane: every control call reaches every engine.
    control: ControlPlane

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a completion for ``request.prompt_token_ids``."""
        ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Sample like ``generate``, yielding the tokens as they are sampled (an async generator).

        The last chunk carries the finish reason; ``collect_stream`` assembles the chunks into the
        ``GenerateOutput`` that ``generate`` would have returned. Leaving the iteration early (``aclose``,
        cancellation) aborts the request; close it with ``contextlib.aclosing`` when breaking out of a loop.
        """
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating, handling in-flight requests according to ``mode``."""
        ...

    async def resume(self) -> None:
        """Continue generating after ``pause``."""
        ...

    async def is_paused(self) -> bool: ...

    async def get_world_size(self) -> int:
        """Number of inference workers that receive weights."""
        ...

    async def close(self) -> None:
        """Release engines and connections."""
        ...


class LocalInferenceClient:
    """Drives in-process ``TorchEngine``s; requests are spread round-robin, control calls reach all."""

    def __init__(self, engines: list[TorchEngine]):
        if not engines:
            raise ValueError("LocalInferenceClient needs at least one engine")
        self.engines = engines
        self.control = InProcessControlPlane(engines)
        self._next = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        engine = self.engines[self._next % len(self.engines)]
        self._next += 1
        return await engine.generate(request)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        engine = self.engines[self._next % len(self.engines)]
        self._next += 1
        # aclosing: leaving this stream early must close (abort) the engine's at once, not at GC.
        async with contextlib.aclosing(engine.generate_stream(request)) as stream:
            async for chunk in stream:
                yield chunk

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.control.pause(mode)

    async def resume(self) -> None:
        await self.control.resume()

    async def is_paused(self) -> bool:
        return all(engine.is_paused for engine in self.engines)

    async def get_world_size(self) -> int:
        return (await self.control.world_size()).total_workers

    async def close(self) -> None:
        for engine in self.engines:
            await engine.shutdown()

    async def __aenter__(self) -> LocalInferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def collect_stream(
    chunks: AsyncIterable[GenerateChunk],
    *,
    stop_at: Callable[[GenerateChunk], int | None] | None = None,
    on_tokens: Callable[[list[int], list[float]], None] | None = None,
) -> GenerateOutput:
    """Concatenate a stream of ``GenerateChunk``s into its ``GenerateOutput`` (the one place streams are
    assembled).

    Args:
        chunks: the stream; the caller closes it (``contextlib.aclosing``), which aborts the engine request
            when the output ends before the stream does.
        stop_at: called with each chunk; a count means the output ends after that many of its tokens with
            finish reason ``stop`` (a stop string completed) and the rest of the stream is not read.
        on_tokens: called with every token and logprob so far after each chunk that added tokens.

    Raises:
        InferenceUnavailableError: the stream ended without a chunk carrying a finish reason.
        Whatever the stream raises.
    """
    token_ids: list[int] = []
    logprobs: list[float] = []
    policy_versions: list[int] = []
    kept_counts: list[tuple[int, list[int] | None]] = []
    async for chunk in chunks:
        keep = stop_at(chunk) if stop_at is not None else None
        count = len(chunk.token_ids) if keep is None else keep
        token_ids += chunk.token_ids[:count]
        logprobs += chunk.logprobs[:count]
        policy_versions += chunk.policy_versions[:count]
        kept_counts.append((count, chunk.kept_counts[:count] if chunk.kept_counts else None))
        if count and on_tokens is not None:
            on_tokens(token_ids, logprobs)
        if keep is not None:
            return GenerateOutput(
                request_id=chunk.request_id,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=FinishReason.STOP,
                policy_versions=policy_versions,
                prompt_len=chunk.prompt_len,
                kept_counts=join_kept_counts(kept_counts),
            )
        if chunk.finish_reason is not None:
            return GenerateOutput(
                request_id=chunk.request_id,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=chunk.finish_reason,
                policy_versions=policy_versions,
                prompt_len=chunk.prompt_len,
                routed_experts=chunk.routed_experts,
                kept_counts=join_kept_counts(kept_counts),
            )
    raise InferenceUnavailableError("the generation stream ended without a finish reason")


async def generate_past_aborts(
    attempt: Callable[[GenerateOutput | None, int], Awaitable[GenerateOutput]],
    *,
    max_tokens: int,
    partial: bool = True,
    max_aborts: int | None = None,
) -> tuple[GenerateOutput, int]:
    """Sample until the output is not aborted (a pause for a weight update ends requests with finish reason
    ``abort``): the one abort-continuation loop of single-turn and agent generation.

    ``attempt(so_far, aborts)`` samples once: with ``partial``, ``so_far`` is the output of the attempts
    before (None at first) and the attempt continues from its tokens (prompt + ``so_far.token_ids``, at most
    ``max_tokens - len(so_far.token_ids)`` new ones), returning only the new tokens; without, ``so_far`` is
    always None and each attempt samples the completion again. ``aborts`` counts the aborted attempts so far
    (e.g. to vary a seed).

    Returns the output (the joined tokens, logprobs and policy versions of every attempt with ``partial``)
    and the number of aborted attempts. An output that reaches ``max_tokens`` through aborts finishes with
    ``length``; after ``max_aborts`` aborts (None: no limit) the last output is returned as aborted.
    """
    so_far: GenerateOutput | None = None
    aborts = 0
    while True:
        output = await attempt(so_far if partial else None, aborts)
        if partial and so_far is not None:
            output = GenerateOutput(
                request_id=so_far.request_id,
                token_ids=so_far.token_ids + output.token_ids,
                logprobs=so_far.logprobs + output.logprobs,
                finish_reason=output.finish_reason,
                policy_versions=so_far.policy_versions + output.policy_versions,
                prompt_len=so_far.prompt_len,
                # The last attempt ran the whole sequence (its prompt holds the earlier tokens).
                routed_experts=output.routed_experts,
                kept_counts=join_kept_counts(
                    [(len(so_far.token_ids), so_far.kept_counts), (len(output.token_ids), output.kept_counts)]
                ),
            )
        so_far = output
        if output.finish_reason is not FinishReason.ABORT:
            return output, aborts
        if partial and len(output.token_ids) >= max_tokens:
            output.finish_reason = FinishReason.LENGTH
            return output, aborts
        if max_aborts is not None and aborts >= max_aborts:
            return output, aborts
        aborts += 1
