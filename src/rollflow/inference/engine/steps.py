"""One engine step, on the worker thread: admission of waiting sequences into KV-cache slots (fair between
requests, with preemption and prefix-cache hits), the prefill, extend and decode forwards, sampling, and
finishing or failing sequences. A mixin of ``TorchEngine`` over its state (see its ``__init__`` and the
module docstring of ``rollflow.inference.engine.engine``)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import structlog
import torch

from rollflow.errors import EngineError, EngineGenerateError
from rollflow.inference.engine.sampler import Sampled, sample
from rollflow.inference.engine.sequences import (
    BatchForward,
    EngineSequence,
    StreamReply,
    common_prefix_len,
    put_batches,
)
from rollflow.messages import (
    FinishReason,
    SamplingParams,
)

log = structlog.get_logger("rollflow.inference.engine.engine")

# Steps the latency-first cap stays on after the engine last held more than one request (``_request_cap_now``).
CAP_LINGER_STEPS = 32


class EngineSteps:
    """The step half of ``TorchEngine``: ``_step`` and what it calls."""

    def _step(self) -> None:
        fresh: list[EngineSequence] = []
        resumed: list[EngineSequence] = []
        followers: list[tuple[EngineSequence, EngineSequence]] = []
        if not self._paused and not self._asleep and self._waiting:
            self._admit(fresh, resumed, followers)
        if fresh:
            self._advance(fresh, self._forward_prefill)
        if resumed:
            self._advance(resumed, self._forward_extend)
        if followers:
            self._advance_followers(followers)
        if self._num_running and not self._frozen:
            self._advance([s for s in self._slots if s is not None], self._forward_decode)
        self.num_steps += 1

    def _admit(
        self,
        fresh: list[EngineSequence],
        resumed: list[EngineSequence],
        followers: list[tuple[EngineSequence, EngineSequence]],
    ) -> None:
        """Admit waiting sequences fairly between requests (the module docstring's bound): the waiting request
        holding the fewest slots first (ties: the one served least recently), into free slots, then, with
        every slot taken, into slots preempted from requests above their fair share. A sequence whose prompt
        one admitted before it in this step has too goes to ``followers`` with that one (its leader)."""
        running = self._running_per_group
        cap = self._request_cap_now()
        if cap is not None:
            # Latency first: trim every request above the cap (its sequences wait, their slots stay free).
            while self._preempt(cap, set(), fresh, resumed, followers):
                pass
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
        # The first sequence admitted in this step with each prompt (and adapter slot) not yet run for it.
        leaders: dict[tuple[tuple[int, ...], int | None], EngineSequence] = {}
        while heap:
            held, _, order, group = heapq.heappop(heap)
            if held != running.get(group, 0):  # a victim of a preemption since it was pushed
                heapq.heappush(heap, (running.get(group, 0), self._last_served.get(group, 0), order, group))
                continue
            if cap is not None and held >= cap:
                continue  # at the cap: its next sequence waits for the others to leave
            if not self._free_slots:
                share = share or self._fair_share()
                if held >= share or not self._preempt(share, admitted, fresh, resumed, followers):
                    break
            # Popped once it holds its slot: a failure here still reaches it.
            sequence = self._waiting.peek(group)
            leader = None
            if self.enable_prefix_caching and not sequence.token_ids:
                prompt_key = (tuple(sequence.run_ids), sequence.adapter_slot)
                leader = leaders.setdefault(prompt_key, sequence)
                if leader is sequence:
                    leader = None
            sequence.slot, cached_len, cached_routes = self._take_slot(
                sequence.run_ids, search=leader is None
            )
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
            if self._adapter_versions is not None and sequence.adapter_slot is None:
                sequence.adapter_slot = self._adapter_versions.current
                sequence.adapter_version = self.policy_version
            if leader is not None:
                followers.append((sequence, leader))
            else:
                (resumed if cached_len else fresh).append(sequence)
            if group in self._waiting.groups():
                heapq.heappush(heap, (held + 1, self._admissions, order, group))
        if len(self._last_served) > 2 * (len(self._waiting.groups()) + self.max_batch_size) + 64:
            # Requests cancelled or aborted while waiting leave their entry behind: forget those.
            waiting = self._waiting.groups()
            self._last_served = {g: t for g, t in self._last_served.items() if g in waiting or g in running}

    def _request_cap_now(self) -> int | None:
        """``request_slot_cap`` while more than one request is in the engine (running or waiting), and for
        ``CAP_LINGER_STEPS`` steps after: short requests one after the other (an agent's turns, an eval's
        prompts) leave gaps of a step or two, and lifting the cap in each would re-admit the long request's
        preempted sequences (a prefill of their whole context) just before the next short one arrives."""
        cap = self.request_slot_cap
        if cap is None:
            return None
        running = self._running_per_group
        if len(running) > 1 or any(g not in running for g in self._waiting.groups()):
            self._cap_until_step = self.num_steps + CAP_LINGER_STEPS
        return cap if self.num_steps < self._cap_until_step else None

    def _fair_share(self) -> int:
        """Slots each request may hold while others wait: ``max_batch_size`` over the requests with sequences
        running or waiting, at least 1."""
        groups = len(self._running_per_group) + sum(
            1 for g in self._waiting.groups() if g not in self._running_per_group
        )
        return max(1, self.max_batch_size // max(1, groups))

    def _preempt(
        self,
        share: int,
        admitted: set[int],
        fresh: list[EngineSequence],
        resumed: list[EngineSequence],
        followers: list[tuple[EngineSequence, EngineSequence]],
    ) -> bool:
        """Free one slot of the request holding the most slots, if it holds more than ``share``: its cheapest
        sequence to recompute (one admitted in this step and not run yet, else the fewest tokens) goes back to
        the head of its request's queue with the tokens it has. Returns whether a slot was freed."""
        running = self._running_per_group
        if not running:
            return False
        group = max(running, key=running.__getitem__)
        if running[group] <= share:
            return False
        candidates = [s for s in self._slots if s is not None and s.group == group]
        victim = min(candidates, key=lambda s: (id(s) not in admitted, s.prompt_len + len(s.token_ids)))
        if id(victim) in admitted:
            admitted.discard(id(victim))
            if victim in resumed:
                resumed.remove(victim)
            elif victim in fresh:
                fresh.remove(victim)
            else:  # a follower; a leader's followers run their prompt themselves (``_advance_followers``)
                followers[:] = [pair for pair in followers if pair[0] is not victim]
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

    def _advance_followers(self, followers: list[tuple[EngineSequence, EngineSequence]]) -> None:
        """Advance sequences admitted beside a leader with the same prompt: each copies the leader's keys and
        values (and routes) of all but the last prompt token and runs that one (``extend``), instead of the
        whole prompt. A follower whose leader did not run (preempted, or failed) runs its prompt itself."""
        shared, alone = [], []
        for sequence, leader in followers:
            # The leader ran its prompt in this step iff it now has a token (it had none at admission).
            (shared if leader.token_ids else alone).append((sequence, leader))
        if shared:
            sources, targets, lengths = [], [], []
            for sequence, leader in shared:
                length = len(sequence.run_ids) - 1
                sources.append(leader.slot)
                targets.append(sequence.slot)
                lengths.append(length)
                sequence.cached_len = length
                if sequence.routes is not None:
                    sequence.routes.append(np.concatenate(leader.routes)[:length])
            self.runner.copy_prefixes(sources, targets, lengths)
            self.shared_prompt_tokens += sum(lengths)
            self._advance([sequence for sequence, _ in shared], self._forward_extend)
        if alone:
            self._advance([sequence for sequence, _ in alone], self._forward_prefill)

    def _forward_prefill(
        self, sequences: list[EngineSequence]
    ) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        self._set_adapter_rows([s.adapter_slot for s in sequences])
        logits = self.runner.prefill([s.slot for s in sequences], [s.run_ids for s in sequences])
        return logits, self._admission_routes(sequences)

    def _forward_extend(
        self, sequences: list[EngineSequence]
    ) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        self._set_adapter_rows([s.adapter_slot for s in sequences])
        logits = self.runner.extend(
            [s.slot for s in sequences],
            [s.run_ids for s in sequences],
            [s.cached_len for s in sequences],
        )
        return logits, self._admission_routes(sequences)

    def _set_adapter_rows(self, slots: list[int | None]) -> None:
        if self._adapter_versions is not None:
            self.runner.adapter_rows = self._adapter_versions.rows([slot or 0 for slot in slots])

    def _admission_routes(self, sequences: list[EngineSequence]) -> list[np.ndarray] | None:
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

    def _forward_decode(
        self, sequences: list[EngineSequence]
    ) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        # Sequences are in slot order; the runner decodes slots 0..num_rows-1, empty or other slots at -1.
        num_rows = sequences[-1].slot + 1
        token_ids = [0] * num_rows
        positions = [-1] * num_rows  # -1: a slot whose cache the runner leaves alone
        for sequence in sequences:
            token_ids[sequence.slot] = sequence.token_ids[-1]
            positions[sequence.slot] = sequence.prompt_len + len(sequence.token_ids) - 1
        if self._adapter_versions is not None:
            rows = [0] * num_rows  # empty rows compute garbage on the base
            for sequence in sequences:
                rows[sequence.slot] = sequence.adapter_slot
            self._set_adapter_rows(rows)
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

    def _advance(self, sequences: list[EngineSequence], forward: BatchForward) -> None:
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
        self, sequences: list[EngineSequence], logits: torch.Tensor
    ) -> tuple[list[bool], list[int], list[EngineSequence], Sampled]:
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

    def _take_slot(self, prompt: list[int], *, search: bool = True) -> tuple[int, int, np.ndarray | None]:
        """A free slot for ``prompt``, how many of its first tokens that slot already holds keys and values for,
        and the routes of the slot's cached tokens (None unless recorded).

        The slot with the longest cached prefix of the prompt wins (at least one prompt token is left to run,
        for the logits); without one (or without ``search``), the lowest unlabelled slot (low slots keep
        decode rows dense), else the least recently used labelled slot, whose label is evicted.
        """
        best_slot, best_len = -1, 0
        if self.enable_prefix_caching and search:
            self.prefix_cache_queries += 1
            self.prefix_cache_query_tokens += len(prompt)
            limit = len(prompt) - 1
            for slot, cached in self._cached_prefixes.items():
                if cached[0] == prompt[0]:
                    length = common_prefix_len(cached, prompt, limit)
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

    def _append_samples(self, sequences: list[EngineSequence], sampled: Sampled) -> None:
        version = self.policy_version
        self.total_generated_tokens += len(sampled.tokens)
        finished: list[tuple[int, FinishReason]] = []
        for sequence, token, logprob, kept_count in zip(sequences, *sampled, strict=True):
            # Unmerged adapters: the version it started on, else the weights' version.
            token_version = version if sequence.adapter_version is None else sequence.adapter_version
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.policy_versions.append(token_version)
            sequence.kept_counts.append(kept_count)
            if token in sequence.stop_token_ids:
                finished.append((sequence.slot, FinishReason.STOP))
            elif len(sequence.token_ids) >= sequence.max_output_len:
                finished.append((sequence.slot, FinishReason.LENGTH))
            if type(sequence.reply) is StreamReply:
                sequence.reply.pending.append((token, logprob, token_version, kept_count))
                self._unsent_streams.add(sequence.reply)
        for slot, reason in finished:
            self._finish(slot, reason)  # a stream's outcome goes out with its pending tokens

    def _fail(self, sequence: EngineSequence, error: BaseException) -> None:
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
                loop.call_soon_threadsafe(put_batches, batches)

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
            # A sequence on an older adapter version (resumed after a preemption) holds that version's cache.
            and (self._adapter_versions is None or sequence.adapter_slot == self._adapter_versions.current)
        ):
            # The last sampled token was never fed back, so its keys and values are not in the cache.
            tokens = sequence.request.prompt_token_ids + sequence.token_ids[:-1]
            self._cached_prefixes[slot] = tokens
            if sequence.routes is not None:  # one row per cached token: the last token's route is unknown too
                self._cached_routes[slot] = sequence.routed_experts()
            self._clock += 1
            self._slot_last_used[slot] = self._clock
