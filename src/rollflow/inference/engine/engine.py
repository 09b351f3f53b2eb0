"""``TorchEngine``: in-process continuous-batching generation on a torch model.

One worker thread owns the model, the KV cache and all scheduling state while there is work (it exits when
idle and the next call starts another). Each loop iteration it:
1. takes everything posted to its inbox (new requests, cancellations, pause/resume, weight loads, shutdown) and
   applies it, so control calls always land between steps, never inside one;
2. admits waiting requests into free KV-cache slots (unless paused), fairly between requests (below), and
   prefills them in one padded batch;
3. runs one decode step over every running slot (unless frozen by ``pause("keep")``).
Results go back to each caller's event loop with ``loop.call_soon_threadsafe``, so the engine serves callers
from any running asyncio loop (several at once, or one per test) and never blocks one. A streamed request
(``generate_stream``) also gets each sampled token that way, into a queue on its caller's loop; the caller
merges whatever arrived since it last looked into one chunk, so a slow consumer never slows the worker.

Fair scheduling: sequences that share a ``request_id`` (the ``n`` samples and prompts of one HTTP request) are
one request; a sequence without an id is a request of its own. Admission serves the waiting request holding the
fewest slots first (ties: the one served least recently), rather than sequences in arrival order, and when every
slot is taken, a request holding fewer than its fair share of slots takes one from the request holding the most
(preemption: that sequence keeps its tokens and goes back to the head of its request's queue; when it is
admitted again its keys and values are recomputed from its prompt and those tokens, in one prefill). The bound:
after each step's admission, each request with sequences waiting holds at least ``min(its sequences,
max(1, max_batch_size // R))`` slots, ``R`` being the number of requests with sequences running or waiting. So,
while fewer than ``max_batch_size`` requests are in the engine, a request that arrives starts its first sequence
in the step after it arrives, however many sequences an earlier request queued (its wait is one step, not the
earlier request's generation). Requests of one sequence each are admitted in arrival order and never preempted.
The bound is in steps: a step over a full batch costs more than one over a lone sequence (on a CPU, about its
rows times the context they attend to), so behind a full batch a short request's wall-clock latency is its
tokens times a full step (``benchmarks/fair_scheduling.py`` measures both).

Prefix cache: a finished request leaves its keys and values in its freed slot, labelled with the tokens they
belong to. A new request whose prompt starts with some of those tokens takes that slot and prefills only the rest
of its prompt (``ModelRunner.extend``); otherwise it takes an unlabelled slot, or evicts the least recently used
label. Loading weights drops every label: keys and values computed under old weights are stale.

Routed experts (``return_routed_experts``, MoE models): each sequence keeps the top-k expert ids of every token
the model ran for it, per MoE layer: its prompt tokens, then each sampled token as it is fed back. The last
sampled token is never fed back, so an output holds ``prompt_len + len(token_ids) - 1`` rows. A cached prefix
keeps its tokens' routes with its keys and values, so a prefix hit returns the same routes as a full prefill.

Sleep (colocation, vLLM's levels): ``sleep(1)`` frees the KV cache and the prefix cache and keeps the weights
(on an accelerator, in CPU memory); ``sleep(2)`` frees the weights too. Nothing is admitted until ``wake_up``
restored both (weights first, so a weight load can fill them while the KV cache still sleeps).

Failures: invalid requests are rejected in ``generate`` with ``EngineError`` before they reach the loop, using
the sampler's bounds (``rollflow.messages.sampling_error``). Inside the loop a failure fails only what it belongs
to: a request whose logits are not finite fails with ``EngineError``; a batched forward or sampling call that
raises is retried one request at a time, and the requests that fail alone get ``EngineGenerateError``; a control
call (a weight load …) that raises answers its caller with the error. Weights holding inf or NaN, or values
that overflow to inf when cast to the dtype the model serves (1e300 in float64 for a float32 model), are refused
before anything is copied. Only a failure outside all of these (a bug in the loop's own bookkeeping) kills the
engine: every pending and later call then raises ``EngineDeadError`` instead of hanging, and ``is_dead`` is True.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import structlog
import torch

from rollflow.errors import ContextLengthExceededError, EngineDeadError, EngineError, EngineGenerateError
from rollflow.inference.client import PAUSE_MODES, LogprobsMode, PauseMode
from rollflow.inference.engine.model_runner import ModelRunner
from rollflow.inference.engine.sampler import Sampled, sample
from rollflow.messages import (
    FinishReason,
    GenerateChunk,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    sampling_error,
)

log = structlog.get_logger(__name__)

# What sleep releases, in vLLM's wake_up tags.
SLEEP_MEMORY_TAGS = ("weights", "kv_cache")


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    # Runs on the caller's loop; the caller may have been cancelled meanwhile.
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
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
class _Reply:
    """Where the worker sends the outcome of one call: a future on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @classmethod
    def create(cls) -> _Reply:
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        # A closed loop raises RuntimeError: its caller is gone, nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)


@dataclass(eq=False)
class _StreamReply:
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
    def create(cls) -> _StreamReply:
        return cls(asyncio.get_running_loop(), asyncio.Queue())

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        batch: list[Any] = self.pending
        self.pending = []
        batch.append((result, error))  # after the tokens still pending
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody reads this
            self.loop.call_soon_threadsafe(self.queue.put_nowait, batch)


def _put_batches(batches: list[tuple[asyncio.Queue, list[Any]]]) -> None:
    for queue, batch in batches:
        queue.put_nowait(batch)


@dataclass(eq=False, slots=True)
class _Sequence:
    """One request's generation state, owned by the worker thread."""

    request: GenerateRequest
    params: SamplingParams
    reply: _Reply | _StreamReply
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


class _WaitQueue:
    """Sequences waiting for a slot, by request (``_Sequence.group``), each request's in arrival order.

    Worker-owned; ``len`` may be read from other threads (a plain int).
    """

    def __init__(self) -> None:
        self._groups: dict[Any, deque[_Sequence]] = {}
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

    def append(self, sequence: _Sequence) -> None:
        self._groups.setdefault(sequence.group, deque()).append(sequence)
        self._count += 1

    def appendleft(self, sequence: _Sequence) -> None:
        """Put a preempted sequence back at the head of its request's queue."""
        self._groups.setdefault(sequence.group, deque()).appendleft(sequence)
        self._count += 1

    def peek(self, group: Any) -> _Sequence:
        return self._groups[group][0]

    def pop(self, group: Any) -> _Sequence:
        """The first waiting sequence of ``group``."""
        queue = self._groups[group]
        sequence = queue.popleft()
        if not queue:
            del self._groups[group]
        self._count -= 1
        return sequence

    def popleft(self) -> _Sequence:
        """The first waiting sequence of the request that has waited longest."""
        return self.pop(next(iter(self._groups)))

    def remove(self, sequence: _Sequence) -> None:
        """Raises ValueError when ``sequence`` is not waiting."""
        queue = self._groups.get(sequence.group)
        if queue is None:
            raise ValueError("not waiting")
        queue.remove(sequence)
        if not queue:
            del self._groups[sequence.group]
        self._count -= 1

    def take_where(self, predicate: Callable[[_Sequence], bool]) -> list[_Sequence]:
        """Remove and return every waiting sequence for which ``predicate`` holds, in queue order."""
        taken: list[_Sequence] = []
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
_Forward = Callable[[list[_Sequence]], tuple[torch.Tensor, list[np.ndarray] | None]]

# Inbox messages: (kind, payload, reply). Kinds: "add", "cancel", "abort", "pause", "resume", "load",
# "reset_prefix_cache", "shutdown".
_Message = tuple[str, Any, _Reply | None]


class TorchEngine:
    """Continuous-batching generation with a KV cache on a Hugging Face Llama-style causal LM (CPU float32).

    Args:
        model: a loaded HF causal LM in eval mode (``model_type`` llama, qwen2 or qwen3). The engine keeps it
            and ``load_weights`` changes it in place, so give the engine its own copy.
        max_batch_size: KV-cache slots, i.e. requests decoded together; more requests queue.
        max_model_len: prompt plus output tokens per request. The KV cache takes ``num_layers * 2 *
            max_batch_size * kv_heads * max_model_len * head_dim`` floats, allocated up front.
        policy_version: stamped on every token sampled until ``load_weights`` sets another.
        num_threads: torch intra-op threads of the engine's worker thread; None keeps torch's current count.
            The default, 1, is fastest for small models on small machines: a second OpenMP thread team next
            to the caller's (the main thread's, the trainer's) makes every parallel op wait on its sleeping
            threads, which measured 2-3x slower per decode step on 2 cores than one thread. Raise it for
            models whose matmuls dominate (a large model, many cores, long prompts).
        enable_prefix_caching: reuse the keys and values of earlier requests' prompt prefixes (see the module
            docstring); False prefills every prompt from scratch.
        return_routed_experts: record each token's top-k expert ids per MoE layer and return them as
            ``GenerateOutput.routed_experts`` (see the module docstring); MoE models only. Off, nothing is recorded.
        logprobs_mode: vLLM's ``--logprobs-mode`` values. ``processed_logprobs``: the logprob of the
            distribution each token was drawn from (after temperature, renormalised over the tokens top-k/top-p
            kept), what the trainer recomputes. ``raw_logprobs``: ``log_softmax(logits)`` before temperature
            and truncation, as vLLM returns by default; only to emulate such a server (tests).

    Stops only on ``SamplingParams.stop_token_ids`` (callers pass the tokenizer's eos there); the stop token is
    part of ``token_ids``. Logprobs are ``log_softmax(logits / temperature)`` at the sampled token over the
    tokens top-k/top-p kept, renormalised there (plain ``log_softmax`` at temperature 0), and each token's kept
    set is recorded as ``GenerateOutput.kept_counts``: what the trainer replays (``trainer.sampling_mask``).

    Pause modes (vLLM's): ``abort`` ends running requests now with finish reason ``abort`` and their partial
    tokens; ``wait`` returns once running requests finished; ``keep`` freezes running requests with their KV
    cache and continues them on ``resume``. In every mode, requests not yet admitted (queued behind a full batch
    or submitted during the pause) stay queued and start after ``resume``.

    Raises:
        EngineError: unsupported architecture (the message names the ``model_type``), or
            ``return_routed_experts`` for a model without MoE layers.
        ValueError: ``max_batch_size`` or ``max_model_len`` out of range.
    """

    # A worker with nothing to do lingers this long, then exits; the next call starts a new one. So an idle
    # engine holds no thread, and no OpenMP thread team that slows the trainer's torch calls (two teams on a
    # 2-core machine halve each other's speed).
    idle_exit_s: float = 0.05
    # A streamed request's tokens go to its caller at most this often (its first token at once): each send
    # wakes the caller's loop, whose Python then competes with this thread for the GIL, so sending every
    # token of a fast model would slow generation (by 30-40% for the tiny model). Decode steps longer than
    # this (real models) send every token as it is sampled.
    stream_interval_s: float = 0.005

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 64,
        max_model_len: int = 1024,
        policy_version: int = 0,
        num_threads: int | None = 1,
        enable_prefix_caching: bool = True,
        return_routed_experts: bool = False,
        logprobs_mode: LogprobsMode = "processed_logprobs",
    ):
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(
                f"logprobs_mode must be 'processed_logprobs' or 'raw_logprobs', got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None (keep torch's count), got {num_threads}")
        model.eval()
        self.num_threads = num_threads
        # Threads that first use torch later start from this count; the worker puts it back after changing it.
        self._process_num_threads = torch.get_num_threads()
        # Swappable: the forward. Fixed: limits and the model.
        self.model = model
        self.runner = ModelRunner(
            model,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            record_routed_experts=return_routed_experts,
        )
        self.return_routed_experts = return_routed_experts
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.vocab_size = self.runner.vocab_size
        self.enable_prefix_caching = enable_prefix_caching

        # Runtime state shared with callers: the inbox, under _lock.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque[_Message] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._dead: BaseException | None = None

        # Runtime state owned by the worker thread (callers only read it for metrics).
        self.policy_version = policy_version
        self._waiting = _WaitQueue()
        self._slots: list[_Sequence | None] = [None] * max_batch_size
        # Fair scheduling (see the module docstring): slots held per request, and when each was last served.
        self._running_per_group: dict[Any, int] = {}
        self._last_served: dict[Any, int] = {}
        self._admissions = 0
        self._free_slots = set(range(max_batch_size))
        # Prefix cache: free slot -> the tokens whose keys and values it still holds; LRU clock per slot.
        self._cached_prefixes: dict[int, list[int]] = {}
        self._weights_generation = 0  # += 1 at every load of new weights (see _Sequence.weights_generation)
        # With routed experts: free slot -> the routes of its cached tokens (row i belongs to token i).
        self._cached_routes: dict[int, np.ndarray] = {}
        self._slot_last_used = [0] * max_batch_size
        self._clock = 0
        self._num_running = 0
        self._paused = False
        self._frozen = False
        # Memory released by sleep (tags "weights", "kv_cache"): nothing is admitted until both are back.
        self._asleep: set[str] = set()
        self._drain_waiters: list[_Reply] = []
        self._unsent_streams: set[_StreamReply] = set()  # streams with tokens not sent yet
        self._stopping = False  # set by the worker when it handles "shutdown"
        self._shared_generator = torch.Generator(device=self.runner.device)
        self._shared_generator.seed()

        # Metrics.
        self.total_generated_tokens = 0
        self.total_prompt_tokens = 0
        self.num_steps = 0
        self.num_finished_requests = 0
        self.num_cancelled_requests = 0
        # Sequences that gave up their slot to a request below its fair share (fair scheduling).
        self.num_preemptions = 0
        # Requests that failed inside the engine (non-finite logits, a failing forward); the engine kept serving.
        self.num_failed_requests = 0
        # Prefix cache, per admitted request: lookups, lookups that hit, and prompt tokens looked up / reused.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> TorchEngine:
        """Load a local HF model directory (or ``rollflow:tiny``, ``rollflow:tiny-moe``) in float32 on CPU and
        wrap it in an engine.

        ``kwargs`` go to ``TorchEngine``. Raises what ``transformers`` raises for a missing model, and
        ``EngineError`` for an unsupported architecture.
        """
        from transformers import AutoModelForCausalLM

        from rollflow.models.loading import EMBEDDED_MODELS

        if path in EMBEDDED_MODELS:
            path = str(EMBEDDED_MODELS[path]())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model.eval(), **kwargs)

    # ------------------------------------------------------------------ public API (any event loop)

    @property
    def is_paused(self) -> bool:
        """True between a completed ``pause`` and the next ``resume``."""
        return self._paused

    @property
    def is_dead(self) -> bool:
        """True once the worker loop died (every call then raises ``EngineDeadError``)."""
        return self._dead is not None

    @property
    def dead_reason(self) -> EngineDeadError:
        """Why the engine cannot serve: the error its calls raise (its loop died, or it was shut down)."""
        return self._dead_error()

    @property
    def num_running(self) -> int:
        """Requests holding a KV-cache slot (including frozen ones)."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet admitted to a slot."""
        with self._lock:
            return len(self._waiting) + sum(1 for kind, _, _ in self._inbox if kind == "add")

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate a completion of ``request.prompt_token_ids``; waits while the engine is paused.

        Cancelling the caller aborts the request and frees its slot.

        Raises:
            EngineError: the request is invalid (empty or too long prompt, token id outside the vocabulary,
                a sampling value outside ``rollflow.messages.sampling_error``'s bounds); the engine keeps
                serving. Also (after admission) when the model produced non-finite logits for it.
            EngineGenerateError: the request failed inside the engine (its forward raised); the engine keeps
                serving the others.
            EngineDeadError: the engine was shut down or its loop died.
        """
        sequence = self._sequence(request, _Reply.create())
        self._post(("add", sequence, None))
        try:
            return await sequence.reply.future
        except asyncio.CancelledError:
            self._post(("cancel", sequence, None), quiet=True)
            raise

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Generate like ``generate``, yielding the tokens sampled since the previous chunk as they come.

        The last chunk has ``finish_reason`` set; an aborted request (pause in abort mode, ``abort``) ends
        with finish reason ``abort`` after its partial tokens. Leaving the iteration early (``aclose``, or
        cancellation while waiting) aborts the request and frees its slot. Requests are checked when the
        iteration starts.

        Raises:
            EngineError: the request is invalid (as ``generate``).
            EngineDeadError: the engine was shut down or its loop died (also mid-stream).
        """
        reply = _StreamReply.create()
        sequence = self._sequence(request, reply)
        self._post(("add", sequence, None))
        finished = False
        try:
            while not finished:
                items = await reply.queue.get()
                while not reply.queue.empty():  # merge what arrived meanwhile into one chunk
                    items += reply.queue.get_nowait()
                chunk = GenerateChunk(request.request_id, [], [], [], prompt_len=sequence.prompt_len)
                kept_counts: list[int] = []
                for item in items:
                    if len(item) == 4:
                        chunk.token_ids.append(item[0])
                        chunk.logprobs.append(item[1])
                        chunk.policy_versions.append(item[2])
                        kept_counts.append(item[3])
                        continue
                    output, error = item
                    finished = True
                    if error is not None:
                        raise error
                    chunk.finish_reason = output.finish_reason
                    chunk.routed_experts = getattr(output, "routed_experts", None)
                if any(kept_counts):
                    chunk.kept_counts = kept_counts
                yield chunk
        finally:
            if not finished:  # the consumer left early or was cancelled: abort the engine request
                self._post(("cancel", sequence, None), quiet=True)

    def _sequence(self, request: GenerateRequest, reply: _Reply | _StreamReply) -> _Sequence:
        self._validate(request)
        params = request.sampling
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        prompt_len = len(request.prompt_token_ids)
        return _Sequence(
            request=request,
            params=params,
            reply=reply,
            generator=generator,
            stop_token_ids=frozenset(params.stop_token_ids),
            prompt_len=prompt_len,
            max_output_len=min(params.max_tokens, self.max_model_len - prompt_len),
            routes=[] if self.return_routed_experts else None,
        )

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop admitting requests and treat running ones according to ``mode`` (see the class docstring).

        Returns once the mode took effect (for ``wait``: once running requests finished).

        Raises:
            ValueError: ``mode`` is not one of "abort", "wait", "keep".
            EngineDeadError: the engine was shut down or its loop died.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")
        await self._call("pause", mode)

    async def resume(self) -> None:
        """Admit requests again and continue frozen ones.

        Raises:
            EngineDeadError: the engine was shut down or its loop died.
        """
        await self._call("resume", None)

    async def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copy tensors (HF state-dict names) into the model in place, between decode steps; tokens sampled
        afterwards carry ``policy_version``. ``lm_head.weight`` may be absent when tied to the embeddings.

        Loading is all-or-nothing: names, shapes and values (finite, real, and still finite once cast to the
        dtype the model serves them in) are checked before anything is copied.

        Raises:
            EngineError: an unknown name, a shape mismatch, or a tensor holding inf or NaN, or values that
                overflow to inf in the serving dtype (the message names them); the weights and policy version
                are unchanged.
            EngineDeadError: the engine was shut down or its loop died.
            TypeError: a value is not convertible to a tensor.
        """
        tensors = [(name, torch.as_tensor(value)) for name, value in named_tensors]
        await self._call("load", (tensors, policy_version))

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The memory ``sleep`` released and ``wake_up`` has not restored yet (``weights``, ``kv_cache``)."""
        return frozenset(self._asleep)

    async def sleep(self, level: int) -> None:
        """Release memory for another process sharing the device (a colocated trainer), as vLLM's sleep.

        Level 1 frees the KV cache and the prefix cache and keeps the weights (on an accelerator they move to
        CPU memory); level 2 frees the weights too (``wake_up`` brings them back zeroed: load weights before
        generating). Nothing is admitted until ``wake_up`` restored both; queued requests wait. No request may
        be running: pause first (``abort`` or ``wait``). On CUDA the freed memory goes back to the driver.

        Raises:
            ValueError: ``level`` is not 1 or 2.
            EngineError: requests are running (or frozen by a ``keep`` pause) and hold KV-cache slots.
            EngineDeadError: the engine was shut down or its loop died.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        await self._call("sleep", level)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``weights``, ``kv_cache``, or both (None). Generation resumes once
        both are back (and the engine is not paused).

        Raises:
            ValueError: a tag other than ``weights`` and ``kv_cache``.
            EngineDeadError: the engine was shut down or its loop died.
        """
        wanted = frozenset(SLEEP_MEMORY_TAGS if tags is None else tags)
        if wanted - set(SLEEP_MEMORY_TAGS):
            raise ValueError(f"wake_up tags must be among {SLEEP_MEMORY_TAGS}, got {sorted(wanted)}")
        await self._call("wake_up", wanted)

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """End running and waiting requests whose ``request_id`` is in ``request_ids`` (all when None) now, with
        finish reason ``abort`` and their partial tokens; returns how many were aborted.

        Raises:
            EngineDeadError: the engine was shut down or its loop died.
        """
        return await self._call("abort", None if request_ids is None else frozenset(request_ids))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (running requests keep their own keys and values). Returns True.

        Raises:
            EngineDeadError: the engine was shut down or its loop died.
        """
        return await self._call("reset_prefix_cache", None)

    async def shutdown(self) -> None:
        """Abort running and waiting requests (finish reason ``abort``) and stop the worker thread. Idempotent."""
        with self._lock:
            if not self._closing:
                self._closing = True
                has_state = self._thread is not None or self._waiting or self._num_running
                if has_state and self._dead is None:
                    self._post_locked(("shutdown", None, None))
            thread = self._thread
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)

    # ------------------------------------------------------------------ caller side helpers

    def _validate(self, request: GenerateRequest) -> None:
        prompt, params = request.prompt_token_ids, request.sampling
        where = f"request {request.request_id!r}: " if request.request_id else ""
        if not prompt:
            raise EngineError(f"{where}prompt_token_ids is empty; pass at least one token")
        if len(prompt) > self.max_model_len - 1:
            raise ContextLengthExceededError(
                f"{where}prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}, which leaves "
                f"room for at most {self.max_model_len - 1} prompt tokens; shorten the prompt or raise max_model_len"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise EngineError(
                f"{where}prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        problem = sampling_error(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
        )
        if problem is not None:
            raise EngineError(f"{where}sampling.{problem[1]}")

    def _post(self, message: _Message, *, quiet: bool = False) -> None:
        with self._lock:
            if self._dead is not None or self._closing:
                if quiet:
                    return
                raise self._dead_error()
            self._post_locked(message)

    def _post_locked(self, message: _Message) -> None:
        self._inbox.append(message)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollflow-torch-engine", daemon=True)
            self._thread.start()
        else:
            self._wakeup.notify()

    async def _call(self, kind: str, payload: Any) -> Any:
        reply = _Reply.create()
        self._post((kind, payload, reply))
        return await reply.future

    def _dead_error(self) -> EngineDeadError:
        if self._dead is not None:
            error = EngineDeadError(f"the engine loop died: {self._dead!r}")
            error.__cause__ = self._dead
            return error
        return EngineDeadError("the engine was shut down")

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            self._set_worker_threads()
            with torch.inference_mode():
                while (messages := self._take_inbox()) is not None:
                    for kind, payload, reply in messages:
                        self._handle_safely(kind, payload, reply)
                    if self._stopping:
                        return
                    self._step()
                    # Frozen (pause "keep"): no step will come to send what is pending.
                    self._send_stream_tokens(force=self._frozen)
                    self._reply_drained()
        except BaseException as exc:
            log.exception("engine loop died")
            self._die(exc)

    def _set_worker_threads(self) -> None:
        # Setting the count in this thread, even to its current value, also turns off MKL's dynamic threading,
        # which otherwise makes small matmuls in a non-main thread 10-50x slower (pytorch/pytorch#13757).
        # get_num_threads first: torch initializes a thread's count lazily, from the process's count, on its first
        # call; after the helper below restored that, a later first call would undo this thread's setting.
        current = torch.get_num_threads()
        count = current if self.num_threads is None else self.num_threads
        torch.set_num_threads(count)
        if count != self._process_num_threads:
            # torch.set_num_threads also sets the count that threads first using torch later start from. Put
            # the process's count back from a helper thread; its own per-thread setting ends with it.
            helper = threading.Thread(target=torch.set_num_threads, args=(self._process_num_threads,))
            helper.start()
            helper.join()

    def _has_work(self) -> bool:
        can_admit = not self._paused and not self._asleep and self._waiting and self._free_slots
        return bool(self._inbox or can_admit or (self._num_running and not self._frozen))

    def _take_inbox(self) -> list[_Message] | None:
        """The next messages, once there is work; None when the worker should exit for lack of work."""
        with self._lock:
            while not self._has_work():
                if not self._wakeup.wait(self.idle_exit_s) and not self._has_work():
                    self._thread = None  # under the lock, so the next _post starts a new worker
                    return None
            messages = list(self._inbox)
            self._inbox.clear()
        return messages

    def _handle_safely(self, kind: str, payload: Any, reply: _Reply | None) -> None:
        """``_handle``, with a failure answered to that message's caller instead of ending the loop."""
        try:
            self._handle(kind, payload, reply)
        except Exception as exc:
            log.exception("engine call failed", kind=kind)
            if reply is not None:
                reply.send(
                    error=EngineGenerateError(f"engine call {kind!r} failed: {type(exc).__name__}: {exc}")
                )

    def _handle(self, kind: str, payload: Any, reply: _Reply | None) -> None:
        if kind == "add":
            self._waiting.append(payload)
        elif kind == "cancel":
            self._cancel(payload)
        elif kind == "abort":
            reply.send(self._abort(payload))
        elif kind == "reset_prefix_cache":
            self._cached_prefixes.clear()
            self._cached_routes.clear()
            reply.send(True)
        elif kind == "pause":
            self._pause(payload, reply)
        elif kind == "resume":
            self._paused = self._frozen = False
            reply.send()
        elif kind == "sleep":
            self._sleep(payload, reply)
        elif kind == "wake_up":
            if "weights" in payload and "weights" in self._asleep:
                self.runner.restore_weights()
            if "kv_cache" in payload and "kv_cache" in self._asleep:
                self.runner.allocate_kv_cache()
            self._asleep -= payload
            reply.send()
        elif kind == "load":
            named_tensors, policy_version = payload
            if named_tensors and "weights" in self._asleep:
                reply.send(
                    error=EngineError(
                        "load_weights while the weights are asleep: wake_up(['weights']) first (after a level 2 "
                        "sleep they come back zeroed, and the load fills them)"
                    )
                )
                return
            try:
                self._load(named_tensors)
            except EngineError as exc:
                reply.send(error=exc)
            else:
                self.policy_version = policy_version
                reply.send()
        elif kind == "shutdown":
            for slot, sequence in enumerate(self._slots):
                if sequence is not None:
                    self._finish(slot, FinishReason.ABORT)
            while self._waiting:
                sequence = self._waiting.popleft()
                sequence.reply.send(sequence.output(FinishReason.ABORT))
            self._reply_drained()
            self._stopping = True

    def _pause(self, mode: str, reply: _Reply) -> None:
        self._paused = True
        if mode == "abort":
            self._frozen = False
            for slot, sequence in enumerate(self._slots):
                if sequence is not None:
                    self._finish(slot, FinishReason.ABORT)
            reply.send()
        elif mode == "keep":
            self._frozen = True
            reply.send()
        else:  # wait: running requests continue (even if frozen before) until none is left
            self._frozen = False
            self._drain_waiters.append(reply)
            self._reply_drained()

    def _sleep(self, level: int, reply: _Reply) -> None:
        if self._num_running:
            reply.send(
                error=EngineError(
                    f"cannot sleep with {self._num_running} request(s) running: their keys and values live in the "
                    "KV cache that sleep frees; pause with mode 'abort' or 'wait' first"
                )
            )
            return
        self._cached_prefixes.clear()
        self._cached_routes.clear()
        self.runner.release_kv_cache()
        self.runner.release_weights(keep=level == 1)
        self._asleep = set(SLEEP_MEMORY_TAGS)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, where the trainer's process can take it
        reply.send()

    def _reply_drained(self) -> None:
        if self._drain_waiters and not self._num_running:
            for reply in self._drain_waiters:
                reply.send()
            self._drain_waiters.clear()

    def _cancel(self, sequence: _Sequence) -> None:
        if sequence.slot >= 0:
            if self._slots[sequence.slot] is sequence:
                self._free(sequence.slot)
                self.num_cancelled_requests += 1
        else:
            with contextlib.suppress(ValueError):  # not waiting: it already finished
                self._waiting.remove(sequence)
                self.num_cancelled_requests += 1

    def _abort(self, request_ids: frozenset[str] | None) -> int:
        aborted = 0
        for slot, sequence in enumerate(self._slots):
            if sequence is not None and (request_ids is None or sequence.request.request_id in request_ids):
                self._finish(slot, FinishReason.ABORT)
                aborted += 1
        for sequence in self._waiting.take_where(
            lambda s: request_ids is None or s.request.request_id in request_ids
        ):
            sequence.reply.send(sequence.output(FinishReason.ABORT))
            aborted += 1
        self._reply_drained()
        return aborted

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict(keep_vars=True)
        unknown = [name for name, _ in named_tensors if name not in state]
        if unknown:
            raise EngineError(
                f"load_weights got {len(unknown)} unknown weight name(s): {', '.join(unknown[:10])}"
                f"{' …' if len(unknown) > 10 else ''}; expected Hugging Face state-dict names such as "
                f"{next(iter(state))!r}"
            )
        mismatched = [
            f"{name} {tuple(tensor.shape)} != {tuple(state[name].shape)}"
            for name, tensor in named_tensors
            if tuple(tensor.shape) != tuple(state[name].shape)
        ]
        if mismatched:
            raise EngineError(f"load_weights got tensors of the wrong shape: {'; '.join(mismatched[:10])}")
        if not named_tensors:
            return  # only the policy version changes
        # Before anything is copied: one NaN or inf weight makes every later generation fail, and the old
        # weights keep serving when the update is refused.
        not_numbers = [
            name for name, tensor in named_tensors if tensor.is_complex() or tensor.dtype == torch.bool
        ]
        if not_numbers:
            raise EngineError(
                f"load_weights got non-real tensors (complex or bool): {', '.join(not_numbers[:10])}"
            )
        non_finite = [
            name
            for name, tensor in named_tensors
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
        ]
        if non_finite:
            raise EngineError(
                f"load_weights got {len(non_finite)} tensor(s) with inf or NaN values: "
                f"{', '.join(non_finite[:10])}{' …' if len(non_finite) > 10 else ''}; the weights were not "
                "changed (the trainer's weights have diverged: lower trainer.lr or check the loss)"
            )
        named_tensors = self._cast_finite(named_tensors, state)
        with torch.inference_mode(False), torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)
        self.runner.refresh_weights()
        self._weights_generation += 1
        self._cached_prefixes.clear()  # computed under the old weights
        self._cached_routes.clear()

    @staticmethod
    def _cast_finite(
        named_tensors: list[tuple[str, torch.Tensor]], state: dict[str, torch.Tensor]
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors cast to the dtypes they are served in, once each is checked to be finite there: a
        finite float64 value beyond float32's range (1e300) becomes inf on the cast, and inf weights make every
        later request fail with non-finite logits.

        Raises:
            EngineError: a tensor that is not finite in its serving dtype (the message names it, its dtypes and
                its largest magnitude); nothing was copied.
        """
        cast: list[tuple[str, torch.Tensor]] = []
        overflowing: list[str] = []
        for name, tensor in named_tensors:
            target = state[name]
            if tensor.dtype != target.dtype:
                served = tensor.to(dtype=target.dtype)
                if served.is_floating_point() and not bool(torch.isfinite(served).all()):
                    largest = float(tensor.abs().max()) if tensor.numel() else 0.0
                    overflowing.append(
                        f"{name} ({str(tensor.dtype).removeprefix('torch.')} -> "
                        f"{str(target.dtype).removeprefix('torch.')}, largest magnitude {largest:.3g} > "
                        f"{torch.finfo(target.dtype).max:.3g})"
                    )
                tensor = served
            cast.append((name, tensor))
        if overflowing:
            raise EngineError(
                f"load_weights got {len(overflowing)} tensor(s) that overflow to inf when cast to the dtype the "
                f"engine serves them in: {'; '.join(overflowing[:10])}{' …' if len(overflowing) > 10 else ''}; "
                "the weights were not changed (the trainer's weights have diverged: lower trainer.lr or check "
                "the loss)"
            )
        return cast

    # ------------------------------------------------------------------ scheduling

    def _step(self) -> None:
        fresh: list[_Sequence] = []
        resumed: list[_Sequence] = []
        if not self._paused and not self._asleep and self._waiting:
            self._admit(fresh, resumed)
        if fresh:
            self._advance(fresh, self._forward_prefill)
        if resumed:
            self._advance(resumed, self._forward_extend)
        if self._num_running and not self._frozen:
            self._advance([s for s in self._slots if s is not None], self._forward_decode)
        self.num_steps += 1

    def _admit(self, fresh: list[_Sequence], resumed: list[_Sequence]) -> None:
        """Admit waiting sequences fairly between requests (the module docstring's bound): the waiting request
        holding the fewest slots first (ties: the one served least recently), into free slots, then, with
        every slot taken, into slots preempted from requests above their fair share."""
        running = self._running_per_group
        if not self._free_slots:
            # Nothing to preempt unless some request holds more than its share: skip the heap (the common case
            # of a long queue of one-sequence requests behind a full batch). Counting a request both running
            # and waiting twice gives a share no larger than the true one, without looking at every request.
            if not running:
                return
            most = max(running.values())
            if most <= max(1, self.max_batch_size // (len(running) + len(self._waiting.groups()))):
                return
            share = self._fair_share()
            if most <= share:
                return
        else:
            share = 0  # computed only if it comes to preempting
        last_served = self._last_served
        heap = [
            (running.get(g, 0), last_served.get(g, 0), i, g) for i, g in enumerate(self._waiting.groups())
        ]
        heapq.heapify(heap)
        admitted: set[int] = set()  # ids of the sequences admitted in this step (not run yet)
        while heap:
            held, _, order, group = heapq.heappop(heap)
            if held != running.get(group, 0):  # a victim of a preemption since it was pushed
                heapq.heappush(heap, (running.get(group, 0), self._last_served.get(group, 0), order, group))
                continue
            if not self._free_slots:
                share = share or self._fair_share()
                if held >= share or not self._preempt(share, admitted, fresh, resumed):
                    break
            # Popped once it holds its slot: a failure here still reaches it.
            sequence = self._waiting.peek(group)
            sequence.slot, cached_len, cached_routes = self._take_slot(sequence.run_ids)
            self._waiting.pop(group)
            self._slots[sequence.slot] = sequence
            self._num_running += 1
            running[group] = held + 1
            self._admissions += 1
            self._last_served[group] = self._admissions
            admitted.add(id(sequence))
            if cached_len and sequence.routes is not None and not sequence.token_ids:
                sequence.routes.append(cached_routes[:cached_len])  # a resumed sequence has its routes
            sequence.cached_len = cached_len
            sequence.weights_generation = self._weights_generation
            (resumed if cached_len else fresh).append(sequence)
            if group in self._waiting.groups():
                heapq.heappush(heap, (held + 1, self._admissions, order, group))
        if len(self._last_served) > 2 * (len(self._waiting.groups()) + self.max_batch_size) + 64:
            # Requests cancelled or aborted while waiting leave their entry behind: forget those.
            waiting = self._waiting.groups()
            self._last_served = {g: t for g, t in self._last_served.items() if g in waiting or g in running}

    def _fair_share(self) -> int:
        """Slots each request may hold while others wait: ``max_batch_size`` over the requests with sequences
        running or waiting, at least 1."""
        groups = len(self._running_per_group) + sum(
            1 for g in self._waiting.groups() if g not in self._running_per_group
        )
        return max(1, self.max_batch_size // max(1, groups))

    def _preempt(
        self, share: int, admitted: set[int], fresh: list[_Sequence], resumed: list[_Sequence]
    ) -> bool:
        """Free one slot of the request holding the most slots, if it holds more than ``share``: its cheapest
        sequence to recompute (one admitted in this step and not run yet, else the fewest tokens) goes back to
        the head of its request's queue with the tokens it has. Returns whether a slot was freed."""
        running = self._running_per_group
        group = max(running, key=running.__getitem__)
        if running[group] <= share:
            return False
        candidates = [s for s in self._slots if s is not None and s.group == group]
        victim = min(candidates, key=lambda s: (id(s) not in admitted, s.prompt_len + len(s.token_ids)))
        if id(victim) in admitted:
            admitted.discard(id(victim))
            (resumed if victim in resumed else fresh).remove(victim)
            if victim.routes is not None and victim.cached_len and not victim.token_ids:
                victim.routes.clear()  # the cached prefix's routes come back with its next admission
        self._release(victim.slot)
        victim.slot = -1
        victim.cached_len = 0
        victim.run_ids = (
            victim.request.prompt_token_ids + victim.token_ids
            if victim.token_ids
            else victim.request.prompt_token_ids
        )
        self._waiting.appendleft(victim)
        self.num_preemptions += 1
        return True

    def _forward_prefill(self, sequences: list[_Sequence]) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        logits = self.runner.prefill([s.slot for s in sequences], [s.run_ids for s in sequences])
        return logits, self._admission_routes(sequences)

    def _forward_extend(self, sequences: list[_Sequence]) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        logits = self.runner.extend(
            [s.slot for s in sequences],
            [s.run_ids for s in sequences],
            [s.cached_len for s in sequences],
        )
        return logits, self._admission_routes(sequences)

    def _admission_routes(self, sequences: list[_Sequence]) -> list[np.ndarray] | None:
        """The routes of the tokens an admission ran that the sequences do not have yet: all of them for a
        new sequence; for one resumed after a preemption, only its last sampled token's (the tokens before it
        kept their routes)."""
        routes = self._routes(range(len(sequences)), [len(s.run_ids) - s.cached_len for s in sequences])
        if routes is None:
            return None
        for i, sequence in enumerate(sequences):
            if sequence.token_ids:
                recorded = sequence.prompt_len + len(sequence.token_ids) - 1
                routes[i] = routes[i][recorded - sequence.cached_len :]
        return routes

    def _forward_decode(self, sequences: list[_Sequence]) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        # Sequences are in slot order; the runner decodes slots 0..num_rows-1, empty or other slots at -1.
        num_rows = sequences[-1].slot + 1
        token_ids = [0] * num_rows
        positions = [-1] * num_rows  # -1: a slot whose cache the runner leaves alone
        for sequence in sequences:
            token_ids[sequence.slot] = sequence.token_ids[-1]
            positions[sequence.slot] = sequence.prompt_len + len(sequence.token_ids) - 1
        logits = self.runner.decode(token_ids, positions)
        routes = self._routes([s.slot for s in sequences], [1] * len(sequences))
        if len(sequences) < num_rows:  # the other rows computed garbage
            logits = logits[torch.tensor([s.slot for s in sequences], device=logits.device)]
        return logits, routes

    def _routes(self, rows: Iterable[int], lengths: list[int]) -> list[np.ndarray] | None:
        """The routes of the tokens each row ran in the last forward: the first ``lengths[i]`` positions of
        runner row ``rows[i]`` (the rest is padding); None when routes are not recorded."""
        if not self.return_routed_experts:
            return None
        routes = self.runner.last_routed_experts.cpu().numpy()  # [rows, positions, moe_layers, topk]
        return [routes[row, :length] for row, length in zip(rows, lengths, strict=True)]

    def _advance(self, sequences: list[_Sequence], forward: _Forward) -> None:
        """Run ``forward`` on ``sequences`` and sample one token each, so that a failure fails only the requests
        it belongs to: rows whose logits are not finite fail alone, and when the batched forward or sampling
        raises, each sequence is retried on its own (a forward only rewrites its rows' own cache positions, so
        running a row again is safe) and those that still fail are failed; the engine keeps serving the rest."""
        try:
            logits, routes = forward(sequences)
            finite, good, kept, sampled = self._sample_finite_rows(sequences, logits)
        except Exception as exc:
            if len(sequences) == 1:
                log.exception(
                    "engine step failed for one request", request_id=sequences[0].request.request_id
                )
                self._fail(
                    sequences[0],
                    EngineGenerateError(
                        f"the request failed inside the engine: {type(exc).__name__}: {exc}; "
                        "the engine keeps serving other requests"
                    ),
                )
                return
            log.warning("batched engine step failed; retrying its requests one at a time", error=repr(exc))
            for sequence in sequences:
                if self._slots[sequence.slot] is sequence:
                    self._advance([sequence], forward)
            return
        for i, ok in enumerate(finite):
            if not ok:
                self._fail(
                    sequences[i],
                    EngineError(
                        f"the model produced non-finite logits (inf or NaN) for request "
                        f"{sequences[i].request.request_id!r} at output position {len(sequences[i].token_ids)}: "
                        "its weights may have diverged; load finite weights that do not overflow"
                    ),
                )
        for i, sequence in zip(good, kept, strict=True):
            if routes is not None:
                sequence.routes.append(routes[i])
            if not sequence.token_ids:  # its first token: the prompt was run
                self.total_prompt_tokens += sequence.prompt_len
        self._append_samples(kept, sampled)

    def _sample_finite_rows(
        self, sequences: list[_Sequence], logits: torch.Tensor
    ) -> tuple[list[bool], list[int], list[_Sequence], Sampled]:
        """Sample the rows whose logits have a finite maximum and no NaN: ``(finite per row, indices of those
        rows, their sequences, what was sampled for them)``.

        On the CPU rows are checked only when sampling says something is wrong (it raised, or gave a non-finite
        logprob, which is what a NaN or +inf logit, or a row of -inf, leads to), so a healthy step pays nothing.
        """
        params = [s.params for s in sequences]
        generators = [s.generator for s in sequences]
        # Off the CPU, rows are checked first: CUDA's sampling asserts on the device instead of raising.
        if logits.device.type == "cpu":
            try:
                sampled = self._sample(logits, params, generators)
                if all(math.isfinite(v) for v in sampled.logprobs):
                    return [True] * len(sequences), list(range(len(sequences))), sequences, sampled
            except RuntimeError:
                pass
        finite = torch.isfinite(logits.amax(dim=-1)).tolist()  # a NaN anywhere makes amax NaN
        if all(finite):  # not the logits' fault: sample again so that a failure raises
            sampled = self._sample(logits, params, generators)
            if not all(math.isfinite(v) for v in sampled.logprobs):
                raise RuntimeError(f"sampling gave non-finite logprobs {sampled.logprobs} from finite logits")
            return finite, list(range(len(sequences))), sequences, sampled
        good = [i for i, ok in enumerate(finite) if ok]
        kept = [sequences[i] for i in good]
        if not kept:
            return finite, good, kept, Sampled([], [], [])
        index = torch.tensor(good, dtype=torch.long, device=logits.device)
        sampled = self._sample(logits[index], [s.params for s in kept], [s.generator for s in kept])
        return finite, good, kept, sampled

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> Sampled:
        return sample(
            logits,
            params,
            generators,
            self._shared_generator,
            raw_logprobs=self.logprobs_mode == "raw_logprobs",
        )

    def _take_slot(self, prompt: list[int]) -> tuple[int, int, np.ndarray | None]:
        """A free slot for ``prompt``, how many of its first tokens that slot already holds keys and values for,
        and the routes of the slot's cached tokens (None unless recorded).

        The slot with the longest cached prefix of the prompt wins (at least one prompt token is left to run,
        for the logits); without one, the lowest unlabelled slot (low slots keep decode rows dense), else the
        least recently used labelled slot, whose label is evicted.
        """
        best_slot, best_len = -1, 0
        if self.enable_prefix_caching:
            self.prefix_cache_queries += 1
            self.prefix_cache_query_tokens += len(prompt)
            limit = len(prompt) - 1
            for slot, cached in self._cached_prefixes.items():
                if cached[0] == prompt[0]:
                    length = _common_prefix_len(cached, prompt, limit)
                    if length > best_len:
                        best_slot, best_len = slot, length
        if best_len:
            self.prefix_cache_hits += 1
            self.prefix_cache_hit_tokens += best_len
            slot = best_slot
        else:
            unlabelled = [s for s in self._free_slots if s not in self._cached_prefixes]
            if unlabelled:
                slot = min(unlabelled)
            else:
                slot = min(self._free_slots, key=self._slot_last_used.__getitem__)
        self._free_slots.remove(slot)
        self._cached_prefixes.pop(slot, None)
        cached_routes = self._cached_routes.pop(slot, None)
        self._clock += 1
        self._slot_last_used[slot] = self._clock
        return slot, best_len, cached_routes

    def _append_samples(self, sequences: list[_Sequence], sampled: Sampled) -> None:
        version = self.policy_version
        self.total_generated_tokens += len(sampled.tokens)
        finished: list[tuple[int, FinishReason]] = []
        for sequence, token, logprob, kept_count in zip(sequences, *sampled, strict=True):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.policy_versions.append(version)
            sequence.kept_counts.append(kept_count)
            if token in sequence.stop_token_ids:
                finished.append((sequence.slot, FinishReason.STOP))
            elif len(sequence.token_ids) >= sequence.max_output_len:
                finished.append((sequence.slot, FinishReason.LENGTH))
            if type(sequence.reply) is _StreamReply:
                sequence.reply.pending.append((token, logprob, version, kept_count))
                self._unsent_streams.add(sequence.reply)
        for slot, reason in finished:
            self._finish(slot, reason)  # a stream's outcome goes out with its pending tokens

    def _fail(self, sequence: _Sequence, error: BaseException) -> None:
        """End one running request with ``error``; its slot is freed without a prefix-cache label (its keys
        and values may be partly written)."""
        slot = sequence.slot
        if slot >= 0 and self._slots[slot] is sequence:
            self._release(slot)
        self.num_failed_requests += 1
        sequence.reply.send(error=error)

    def _send_stream_tokens(self, *, force: bool) -> None:
        """Send streams' pending tokens, those last sent ``stream_interval_s`` ago (all with ``force``): one
        ``call_soon_threadsafe`` per caller loop."""
        if not self._unsent_streams:
            return
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list[Any]]]] = {}
        for reply in list(self._unsent_streams):
            if not reply.pending:  # sent with its outcome meanwhile
                self._unsent_streams.discard(reply)
            elif force or now - reply.last_sent >= self.stream_interval_s:
                by_loop.setdefault(reply.loop, []).append((reply.queue, reply.pending))
                reply.pending, reply.last_sent = [], now
                self._unsent_streams.discard(reply)
        for loop, batches in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody reads this
                loop.call_soon_threadsafe(_put_batches, batches)

    def _finish(self, slot: int, reason: FinishReason) -> None:
        sequence = self._slots[slot]
        self._free(slot)
        self.num_finished_requests += 1
        sequence.reply.send(sequence.output(reason))

    def _release(self, slot: int) -> None:
        """Free ``slot`` without a prefix-cache label (its keys and values may be partly written)."""
        sequence = self._slots[slot]
        self._slots[slot] = None
        self._free_slots.add(slot)
        self._num_running -= 1
        self._cached_prefixes.pop(slot, None)
        self._cached_routes.pop(slot, None)
        if sequence is not None:
            group = sequence.group
            held = self._running_per_group.get(group, 0) - 1
            if held > 0:
                self._running_per_group[group] = held
            else:
                self._running_per_group.pop(group, None)
                if group not in self._waiting.groups():
                    self._last_served.pop(group, None)

    def _free(self, slot: int) -> None:
        sequence = self._slots[slot]
        self._release(slot)
        if (
            self.enable_prefix_caching
            and sequence is not None
            and sequence.weights_generation == self._weights_generation
        ):
            # The last sampled token was never fed back, so its keys and values are not in the cache.
            tokens = sequence.request.prompt_token_ids + sequence.token_ids[:-1]
            self._cached_prefixes[slot] = tokens
            if sequence.routes is not None:  # one row per cached token: the last token's route is unknown too
                self._cached_routes[slot] = sequence.routed_experts()
            self._clock += 1
            self._slot_last_used[slot] = self._clock

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            messages = list(self._inbox)
            self._inbox.clear()
        error = self._dead_error()
        replies = [s.reply for s in self._waiting] + [s.reply for s in self._slots if s is not None]
        replies += self._drain_waiters
        replies += [payload.reply if kind == "add" else reply for kind, payload, reply in messages]
        for reply in replies:
            if reply is not None:
                reply.send(error=error)
