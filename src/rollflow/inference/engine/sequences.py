"""The engine's sequences and their bookkeeping: one ``EngineSequence`` per sample, the replies that carry results
back to each caller's event loop (``Reply``, ``StreamReply``), and the fair wait queue (``WaitQueue``, one
queue per request). Owned by ``TorchEngine``'s worker thread; see ``rollflow.inference.engine.engine``."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollflow.messages import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    # Runs on the caller's loop; the caller may have been cancelled meanwhile.
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``; a binary search over slice
    comparisons, which run in C (a Python loop over thousands of tokens per free slot would not)."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False)
class Reply:
    """Where the worker sends the outcome of one call: a future on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @classmethod
    def create(cls) -> Reply:
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        # A closed loop raises RuntimeError: its caller is gone, nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)


@dataclass(eq=False)
class StreamReply:
    """Where the worker sends a streamed request's tokens and its outcome: a queue on the caller's loop.

    The queue receives batches (lists) of items, in order: ``(token, logprob, policy_version, kept_count)``
    per sampled token, then one final ``(GenerateOutput | None, error | None)``. ``call_soon_threadsafe`` callbacks run
    in the order they were scheduled, so the caller sees tokens in sampling order and the outcome last.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Worker-owned: tokens sampled but not sent yet, and when tokens were last sent (time.monotonic()).
    pending: list[tuple[int, float, int, int]] = field(default_factory=list)
    last_sent: float = 0.0

    @classmethod
    def create(cls) -> StreamReply:
        return cls(asyncio.get_running_loop(), asyncio.Queue())

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        batch: list[Any] = self.pending
        self.pending = []
        batch.append((result, error))  # after the tokens still pending
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody reads this
            self.loop.call_soon_threadsafe(self.queue.put_nowait, batch)


def put_batches(batches: list[tuple[asyncio.Queue, list[Any]]]) -> None:
    for queue, batch in batches:
        queue.put_nowait(batch)


@dataclass(eq=False, slots=True)
class EngineSequence:
    """One request's generation state, owned by the worker thread."""

    request: GenerateRequest
    params: SamplingParams
    reply: Reply | StreamReply
    generator: torch.Generator | None
    stop_token_ids: frozenset[int]
    prompt_len: int
    # Output length at which the request ends with "length": max_tokens, or what the context has left.
    max_output_len: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    # The sampler's kept count of each token (0: nothing cut); see ``rollflow.inference.engine.sampler``.
    kept_counts: list[int] = field(default_factory=list)
    slot: int = -1
    # Prompt tokens whose keys and values the slot already held at admission (prefix cache); 0 for a prefill.
    cached_len: int = 0
    # The engine's weights generation at admission: keys and values computed under older weights (a request
    # kept running through a weight update) never become a cached prefix.
    weights_generation: int = 0
    # Unmerged adapters (``adapter_versions.py``): the adapter slot and policy version it runs on, set at its
    # first admission; None otherwise.
    adapter_slot: int | None = None
    adapter_version: int | None = None
    # Routes [tokens, moe_layers, topk] of the tokens run so far, in pieces (one per forward); None when the
    # engine does not record them.
    routes: list[np.ndarray] | None = None
    # The request it belongs to for fair scheduling: its request_id, or the sequence itself when it has none.
    group: Any = None
    # The tokens its admission runs: the prompt, or after a preemption the prompt and the tokens sampled so far.
    run_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = self.request.request_id or self
        if not self.run_ids:
            self.run_ids = self.request.prompt_token_ids

    def routed_experts(self) -> np.ndarray | None:
        """The routes joined into one array (kept joined); None if not recorded or never admitted."""
        if not self.routes:
            return None
        if len(self.routes) > 1:
            self.routes[:] = [np.concatenate(self.routes)]
        joined = self.routes[0]
        joined.flags.writeable = False  # shared by the output and the prefix cache
        return joined

    def output(self, finish_reason: FinishReason) -> GenerateOutput:
        return GenerateOutput(
            request_id=self.request.request_id,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            policy_versions=self.policy_versions,
            prompt_len=self.prompt_len,
            routed_experts=self.routed_experts(),
            kept_counts=self.kept_counts if any(self.kept_counts) else None,
        )


class WaitQueue:
    """Sequences waiting for a slot, by request (``EngineSequence.group``), each request's in arrival order.

    Worker-owned; ``len`` may be read from other threads (a plain int).
    """

    def __init__(self) -> None:
        self._groups: dict[Any, deque[EngineSequence]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self):
        for queue in list(self._groups.values()):
            yield from list(queue)

    def groups(self) -> Iterable[Any]:
        """The requests with sequences waiting."""
        return self._groups.keys()

    def append(self, sequence: EngineSequence) -> None:
        self._groups.setdefault(sequence.group, deque()).append(sequence)
        self._count += 1

    def appendleft(self, sequence: EngineSequence) -> None:
        """Put a preempted sequence back at the head of its request's queue."""
        self._groups.setdefault(sequence.group, deque()).appendleft(sequence)
        self._count += 1

    def peek(self, group: Any) -> EngineSequence:
        return self._groups[group][0]

    def pop(self, group: Any) -> EngineSequence:
        """The first waiting sequence of ``group``."""
        queue = self._groups[group]
        sequence = queue.popleft()
        if not queue:
            del self._groups[group]
        self._count -= 1
        return sequence

    def popleft(self) -> EngineSequence:
        """The first waiting sequence of the request that has waited longest."""
        return self.pop(next(iter(self._groups)))

    def remove(self, sequence: EngineSequence) -> None:
        """Raises ValueError when ``sequence`` is not waiting."""
        queue = self._groups.get(sequence.group)
        if queue is None:
            raise ValueError("not waiting")
        queue.remove(sequence)
        if not queue:
            del self._groups[sequence.group]
        self._count -= 1

    def take_where(self, predicate: Callable[[EngineSequence], bool]) -> list[EngineSequence]:
        """Remove and return every waiting sequence for which ``predicate`` holds, in queue order."""
        taken: list[EngineSequence] = []
        for group in list(self._groups):
            queue = self._groups[group]
            kept = deque(s for s in queue if not predicate(s))
            taken += [s for s in queue if predicate(s)]
            if kept:
                self._groups[group] = kept
            else:
                del self._groups[group]
        self._count -= len(taken)
        return taken


# One forward of a group of sequences: their last-position logits [n, vocab], and per sequence the routes of
# the tokens it ran (None unless recorded). It changes nothing in the engine's bookkeeping.
BatchForward = Callable[[list[EngineSequence]], tuple[torch.Tensor, list[np.ndarray] | None]]

# Inbox messages: (kind, payload, reply). Kinds: "add", "cancel", "abort", "pause", "resume", "load",
# "reset_prefix_cache", "shutdown".
InboxMessage = tuple[str, Any, Reply | None]
