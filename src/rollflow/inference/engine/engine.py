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

Where the parts live: the public API, the inbox and the worker loop here; the control messages the loop
applies in ``control_messages``; one step (admission, forwards, sampling, finishing) in ``steps``; sequences,
replies and the fair wait queue in ``sequences``.

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

Latency first (``max_request_share``, off by default): while another request is in the engine, no request holds
more than ``max(1, max_request_share * max_batch_size)`` slots; one holding more when another arrives is
preempted down to that cap, and the slots stay free. Steps then stay small while short requests share the
engine with a long one, at the long one's expense; alone, a request takes every slot again. Requests of one
sequence each (a training run's usual traffic) are never capped.

Prefix cache: a finished request leaves its keys and values in its freed slot, labelled with the tokens they
belong to. A new request whose prompt starts with some of those tokens takes that slot and prefills only the rest
of its prompt (``ModelRunner.extend``); otherwise it takes an unlabelled slot, or evicts the least recently used
label. Loading weights drops every label: keys and values computed under old weights are stale. Sequences
admitted in one step with the same prompt (a group's samples, sent as separate requests) share it: the first
runs the prompt, the others copy its keys and values but the last prompt token's and run that one token
(``shared_prompt_tokens`` counts what they did not run).

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
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio
import numpy as np
import structlog
import torch

from rollflow.errors import ContextLengthExceededError, EngineDeadError, EngineError
from rollflow.inference.client import PAUSE_MODES, LogprobsMode, PauseMode
from rollflow.inference.engine.adapter_versions import AdapterVersions
from rollflow.inference.engine.adapters import AdapterMerge
from rollflow.inference.engine.control_messages import SLEEP_MEMORY_TAGS, EngineControlMessages
from rollflow.inference.engine.model_runner import ModelRunner
from rollflow.inference.engine.sequences import EngineSequence, InboxMessage, Reply, StreamReply, WaitQueue
from rollflow.inference.engine.steps import EngineSteps
from rollflow.messages import (
    GenerateChunk,
    GenerateOutput,
    GenerateRequest,
    sampling_error,
)

log = structlog.get_logger(__name__)


class TorchEngine(EngineControlMessages, EngineSteps):
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
        adapter_versions: 0 merges each LoRA adapter push into the weights it serves (one version at a time);
            N > 0 keeps the last N versions unmerged, and a request decodes to its end on the version it
            started on (``adapter_versions.py``).

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
    # An engine with nothing running that receives a request waits for more while they keep coming, in slices
    # of this (at most ``admission_linger_max_s``), before its first step: a training step's requests arrive
    # over a few of the caller's loop iterations, and admitting the first few alone splits the batch into more,
    # smaller steps (the quickstart's generation: 17.5 engine steps instead of 14). A lone request waits one
    # slice.
    admission_linger_s: float = 0.0005
    admission_linger_max_s: float = 0.005

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
        max_request_share: float | None = None,
        adapter_versions: int = 0,
    ):
        if max_request_share is not None and not 0 < max_request_share <= 1:
            raise ValueError(f"max_request_share must be in (0, 1] or None, got {max_request_share}")
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
        self._inbox: deque[InboxMessage] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._dead: BaseException | None = None

        # Runtime state owned by the worker thread (callers only read it for metrics).
        self.policy_version = policy_version
        self._waiting = WaitQueue()
        self._slots: list[EngineSequence | None] = [None] * max_batch_size
        # Fair scheduling (see the module docstring): slots held per request, and when each was last served.
        self._running_per_group: dict[Any, int] = {}
        self._last_served: dict[Any, int] = {}
        self._admissions = 0
        # Latency-first cap (see the module docstring): the most slots one request may hold while another is
        # in the engine; None: a request may hold every slot nobody else claims.
        self.request_slot_cap = (
            None if max_request_share is None else max(1, int(max_request_share * max_batch_size))
        )
        self._cap_until_step = 0  # the cap holds before this step (steps.CAP_LINGER_STEPS)
        self._free_slots = set(range(max_batch_size))
        # Prefix cache: free slot -> the tokens whose keys and values it still holds; LRU clock per slot.
        self._cached_prefixes: dict[int, list[int]] = {}
        # LoRA pushes: unmerged base copies of the adapted modules and the adapter as received (adapters.py).
        self._adapters = AdapterMerge()
        # adapter_versions > 0: adapters unmerged instead, that many versions in flight (adapter_versions.py).
        self._adapter_versions: AdapterVersions | None = None
        if adapter_versions:
            self._adapter_versions = AdapterVersions(model, adapter_versions)
            self.runner.adapter_stack = self._adapter_versions.stack
        self._weights_generation = (
            0  # += 1 at every load of new weights (see EngineSequence.weights_generation)
        )
        # With routed experts: free slot -> the routes of its cached tokens (row i belongs to token i).
        self._cached_routes: dict[int, np.ndarray] = {}
        self._slot_last_used = [0] * max_batch_size
        self._clock = 0
        self._num_running = 0
        self._paused = False
        self._frozen = False
        # Memory released by sleep (tags "weights", "kv_cache"): nothing is admitted until both are back.
        self._asleep: set[str] = set()
        self._drain_waiters: list[Reply] = []
        self._unsent_streams: set[StreamReply] = set()  # streams with tokens not sent yet
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
        self.shared_prompt_tokens = 0

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
        sequence = self._sequence(request, Reply.create())
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
        reply = StreamReply.create()
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

    def _sequence(self, request: GenerateRequest, reply: Reply | StreamReply) -> EngineSequence:
        self._validate(request)
        params = request.sampling
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        prompt_len = len(request.prompt_token_ids)
        return EngineSequence(
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

    def adapter_checksums(self) -> dict[str, str]:
        """SHA-256 of each LoRA adapter tensor the engine serves, as it arrived: ``{name: hex}`` (empty
        before any adapter load). Read between loads (the weight barrier pauses the engine around them)."""
        if self._adapter_versions is not None:
            return self._adapter_versions.checksums()
        return self._adapters.checksums()

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

    def _post(self, message: InboxMessage, *, quiet: bool = False) -> None:
        with self._lock:
            if self._dead is not None or self._closing:
                if quiet:
                    return
                raise self._dead_error()
            self._post_locked(message)

    def _post_locked(self, message: InboxMessage) -> None:
        self._inbox.append(message)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollflow-torch-engine", daemon=True)
            self._thread.start()
        else:
            self._wakeup.notify()

    async def _call(self, kind: str, payload: Any) -> Any:
        reply = Reply.create()
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

    def _linger_locked(self) -> None:
        """Let a burst of requests arrive (``admission_linger_s``): sleep a slice at a time, without the lock,
        while the inbox keeps growing."""
        deadline = time.monotonic() + self.admission_linger_max_s
        seen = len(self._inbox)
        while self.admission_linger_s > 0:
            self._lock.release()
            try:
                time.sleep(self.admission_linger_s)
            finally:
                self._lock.acquire()
            if len(self._inbox) == seen or self._closing or time.monotonic() >= deadline:
                return
            seen = len(self._inbox)

    def _take_inbox(self) -> list[InboxMessage] | None:
        """The next messages, once there is work; None when the worker should exit for lack of work."""
        with self._lock:
            idle = not self._num_running and not self._waiting
            while not self._has_work():
                if not self._wakeup.wait(self.idle_exit_s) and not self._has_work():
                    self._thread = None  # under the lock, so the next _post starts a new worker
                    return None
            if idle and any(kind == "add" for kind, _, _ in self._inbox):
                self._linger_locked()
            messages = list(self._inbox)
            self._inbox.clear()
        return messages

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
