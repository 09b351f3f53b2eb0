"""The engine's control messages, applied on the worker thread between steps: new requests, cancellation,
abort, pause and resume, sleep and wake-up, prefix-cache reset and weight loads (refusing weights that are not
finite in the served dtype). A mixin of ``TorchEngine`` over its state (see its ``__init__``)."""

from __future__ import annotations

import contextlib
from typing import Any

import structlog
import torch

from rollflow.errors import EngineError, EngineGenerateError
from rollflow.inference.engine.adapters import is_adapter_name
from rollflow.inference.engine.sequences import EngineSequence, Reply
from rollflow.messages import (
    FinishReason,
)

log = structlog.get_logger("rollflow.inference.engine.engine")

# What sleep releases, in vLLM's wake_up tags.
SLEEP_MEMORY_TAGS = ("weights", "kv_cache")


class EngineControlMessages:
    """The inbox half of ``TorchEngine``: ``_handle`` and the handlers it calls."""

    def _handle_safely(self, kind: str, payload: Any, reply: Reply | None) -> None:
        """``_handle``, with a failure answered to that message's caller instead of ending the loop."""
        try:
            self._handle(kind, payload, reply)
        except Exception as exc:
            log.exception("engine call failed", kind=kind)
            if reply is not None:
                reply.send(
                    error=EngineGenerateError(f"engine call {kind!r} failed: {type(exc).__name__}: {exc}")
                )

    def _handle(self, kind: str, payload: Any, reply: Reply | None) -> None:
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
                self._load(named_tensors, policy_version)
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

    def _pause(self, mode: str, reply: Reply) -> None:
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

    def _sleep(self, level: int, reply: Reply) -> None:
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

    def _cancel(self, sequence: EngineSequence) -> None:
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

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int) -> None:
        state = self.model.state_dict(keep_vars=True)
        adapter = [(name, tensor) for name, tensor in named_tensors if is_adapter_name(name)]
        if adapter and self._adapter_versions is not None:
            # Unmerged: a new slot for this version; sequences running keep theirs (adapter_versions.py).
            held = [
                s.adapter_slot for s in (*self._slots, *self._waiting) if s is not None and s.adapter_slot
            ]
            self._adapter_versions.put(adapter, policy_version, held)
            self._weights_generation += 1  # prefixes cached under the older adapter are not this one's
            self._cached_prefixes.clear()
            self._cached_routes.clear()
            named_tensors = [(name, tensor) for name, tensor in named_tensors if not is_adapter_name(name)]
            if not named_tensors:
                return
            adapter = []
        # LoRA adapter tensors become the merged weights of their modules (adapters.py).
        if adapter:
            named_tensors = [(name, tensor) for name, tensor in named_tensors if not is_adapter_name(name)]
            full = dict(named_tensors)
            merged = self._adapters.merged(adapter, state, full)
            if any(name == "lm_head.weight" for name, _ in merged) and self._untie_lm_head():
                state = self.model.state_dict(keep_vars=True)
            named_tensors = named_tensors + merged
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
        if adapter:
            self._adapters.commit(adapter, state, full)  # base copies before the merged weights go over them
        elif self._adapters.base:
            self._adapters.commit([], state, dict(named_tensors))
        with torch.inference_mode(False), torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)
        self.runner.refresh_weights()
        self._weights_generation += 1
        self._cached_prefixes.clear()  # computed under the old weights
        self._cached_routes.clear()

    def _untie_lm_head(self) -> bool:
        """Give a head tied to the input embeddings a weight of its own (an adapter on ``lm_head`` changes
        the logits only); True when it was tied."""
        head, embed = self.model.lm_head, self.model.model.embed_tokens
        if head.weight is not embed.weight:
            return False
        with torch.inference_mode(False), torch.no_grad():
            head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        self.model.config.tie_word_embeddings = False
        return True

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
