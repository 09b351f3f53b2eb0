"""The single-process torch trainer: the optimizer updates of the GRPO-family loss on one packed batch.

It trains on exactly the tokens the sampler produced: each sample's input is ``prompt_token_ids +
completion_token_ids``, the loss covers the completion tokens only, and the behaviour logprob of each of them
is the one the sampler recorded. It trains packed batches (``PackedBatch``: the orchestrator's packer computed
each sample's advantage within its whole group and split the samples into micro-batches per data-parallel rank);
a step is ``trainer.ppo_epochs`` passes of one optimizer update per mini-batch of whole groups
(``trainer.mini_batches``). Each update's loss is normalised over its whole mini-batch, all ranks included
(``trainer.loss_agg``, ``aggregation.py``), so micro-batching and the split across ranks change memory use,
not the update.
Tokens sampled by older policies are corrected per ``trainer.off_policy`` (``off_policy.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import structlog
import torch

from rollflow.config import OffPolicyTable, TrainerConfig
from rollflow.config.trainer import correction_for_name
from rollflow.messages import PackedBatch, RankBatch, Sample, StepResult
from rollflow.train import routing_replay, updates
from rollflow.train.advantages import kl_penalised_advantages
from rollflow.train.aggregation import UpdateCounts, kl_estimate, token_loss_scale, update_counts
from rollflow.train.checkpoint_io import OPTIMIZER_FILE as OPTIMIZER_FILE
from rollflow.train.checkpoint_io import WEIGHTS_FILE as WEIGHTS_FILE
from rollflow.train.checkpoint_io import TrainerCheckpoints
from rollflow.train.distributed import SINGLE_PROCESS, DataParallel, SingleProcess
from rollflow.train.losses import TokenLogprobs, model_token_logprobs, policy_loss
from rollflow.train.micro_batch import MicroBatch as MicroBatch
from rollflow.train.micro_batch import build_micro_batch as build_micro_batch
from rollflow.train.off_policy import ImportanceWeights, OffPolicy, behaviour_correction
from rollflow.train.off_policy_metrics import DriftMeter
from rollflow.train.shared_prompts import supports_shared_prompts

log = structlog.get_logger(__name__)


class Trainer(TrainerCheckpoints):
    """Trains a Hugging Face causal LM in this process with AdamW and gradient accumulation.

    One ``train_step`` is one optimizer step. The gradients a step computed stay in ``param.grad`` until the
    next step computes new ones; a step skipped for non-finite values clears them.

    Args:
        model: a causal LM whose forward takes ``input_ids`` and ``attention_mask`` and returns ``.logits``.
        config: optimizer, micro-batching, advantage and loss settings.
        temperature: the sampler's temperature; logprobs are ``log_softmax(logits / temperature)`` so they
            are comparable with the ones the sampler recorded.
        pad_token_id: id used to right-pad micro-batches (never part of the loss).
        seed: seeds the trainer's own torch generator (global RNG state is left alone).
        off_policy: the resolved off-policy correction, ``config.off_policy_correction(orchestrator.mode)``
            (or a name, ``none``, ``tis`` or ``decoupled``, with ``config``'s caps). None takes
            ``config.off_policy`` with ``auto`` resolved as in ``sync`` mode (``none``).
        total_steps: optimizer steps of the run (``orchestrator.steps``), the length of a ``linear`` or
            ``cosine`` ``lr_schedule``.
        reference_model: the initial policy for the KL penalty (``config.kl_coef > 0``), built the way
            ``model`` was (a data-parallel rank passes its own, sharded like the policy under ``fsdp2``);
            None: a frozen copy of ``model``. Frozen here either way; unused without the penalty.

    The model is moved to ``config.device`` with float32 weights (the master weights: gradients and AdamW
    state are float32 too); ``config.dtype = "bfloat16"`` computes the forward under ``torch.autocast``.

    Raises:
        ConfigError: ``config.device`` or ``config.dtype`` is not available on this machine.
        ValueError: a bad ``off_policy`` or ``temperature``, or a decaying ``lr_schedule`` without
            ``total_steps``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        *,
        temperature: float = 1.0,
        pad_token_id: int = 0,
        seed: int = 0,
        off_policy: OffPolicy | OffPolicyTable | None = None,
        total_steps: int | None = None,
        reference_model: torch.nn.Module | None = None,
    ) -> None:
        from rollflow.models.loading import resolve_device, resolve_dtype

        if off_policy is None:
            correction = config.off_policy_correction("sync")
        elif isinstance(off_policy, OffPolicyTable):
            correction = off_policy.with_defaults()
        else:
            correction = correction_for_name(off_policy, config)
        if temperature <= 0:
            raise ValueError(
                f"temperature = {temperature} cannot be trained on: greedy sampling has no logprobs to "
                "compare; sample with sampling.temperature > 0"
            )
        if config.lr_schedule != "constant" and not total_steps:
            raise ValueError(
                f"trainer.lr_schedule = {config.lr_schedule!r} decays over the run: pass total_steps "
                "(orchestrator.steps)"
            )
        # Fixed settings
        self.config = config
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.correction = correction
        self.off_policy = correction.kind
        self.device = resolve_device(config.device, "trainer.device")
        self.compute_dtype = resolve_dtype(config.dtype, self.device, "trainer.dtype")
        # LoRA: the adapter goes in before the model moves (a data-parallel rank's went in before sharding).
        self.lora = config.lora
        if self.lora is not None:
            from rollflow.train.lora import apply_lora

            model = apply_lora(model, self.lora, seed=seed)
        # Model and optimizer: float32 master weights on the device, whatever the compute dtype.
        self.model = model.to(device=self.device, dtype=torch.float32)
        if self.lora is not None and self.device.type == "cuda" and self.compute_dtype == torch.bfloat16:
            # The frozen base has no master weights to keep: bf16 halves its memory (the adapter stays fp32).
            for parameter in self.model.parameters():
                if not parameter.requires_grad and not hasattr(parameter, "full_tensor"):  # not shards
                    parameter.data = parameter.data.to(torch.bfloat16)
        # MoE: forwards replay the experts the sampler chose when samples carry them (routing_replay.py).
        self.routing_replay = routing_replay.install(self.model)
        # Shared prompts pack rows; routes are laid out per row, so replay runs the rows as they are.
        self.share_prompts = (
            config.share_prompts and not self.routing_replay and supports_shared_prompts(self.model)
        )
        # The initial policy, frozen, for the KL penalty; no copy at all when the penalty is off. With LoRA
        # it is the base model itself, the adapter switched off (``_reference_logprobs``).
        self.reference_model: torch.nn.Module | None = None
        if config.kl_coef > 0 and self.lora is None:
            if reference_model is None:
                reference_model = copy.deepcopy(model)
            else:
                reference_model = reference_model.to(device=self.device, dtype=torch.float32)
                routing_replay.install(reference_model)
            self.reference_model = reference_model.eval().requires_grad_(False)
        if config.gradient_checkpointing:
            # Non-reentrant checkpointing works with inputs that need no grad and under autocast. Newer
            # transformers name it activation_checkpointing_enable (the old name a deprecated alias); releases
            # before that (5.17, say) have only gradient_checkpointing_enable.
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)({"use_reentrant": False})
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=tuple(config.betas),
            weight_decay=config.weight_decay,
        )
        self.scheduler = _lr_scheduler(self.optimizer, config, total_steps)
        # Runtime state
        self.generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------ training

    parallel: SingleProcess | DataParallel = SINGLE_PROCESS
    """This trainer's data-parallel rank; a trainer worker sets its group's (``rollflow.train.workers``)."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the trainer's batches are packed for."""
        return self.parallel.world_size

    def train_step(self, batch: PackedBatch | RankBatch, policy_version: int | None = None) -> StepResult:
        """Run one training step on ``batch``; blocking (call it from a worker thread).

        A step is ``trainer.ppo_epochs`` passes over the batch, each one optimizer update per mini-batch
        (``trainer.mini_batches``, packed by ``pack_batch``); the PPO ratio of every update is taken against
        logprobs fixed at the start of the step (``off_policy.py``). An update is skipped (gradients cleared)
        when its loss or gradient norm is not finite; the step is skipped (``updated=False``, weights and
        optimizer state untouched) when the batch has no trainable tokens or no update was taken. On a
        data-parallel rank the loss denominators, the metrics and these decisions are the whole update's
        (all-reduced), so every rank takes the same ones and the same number of updates.

        Metrics: ``loss``, ``grad_norm``, ``clip_fraction``, ``ratio_mean``, ``approx_kl`` (k3 estimate of
        KL(anchor || policy) on the sampled tokens, the anchor being the ratio's: behaviour or start
        logprobs) and ``kl`` (KL penalty in the loss) are means over the passes, each pass a token mean
        (``loss``, ``grad_norm``: the mean over its updates), and with ``ppo_epochs > 1`` also per pass as
        ``ppo_epoch_N/<name>``; ``entropy`` and ``logprob_mismatch`` describe the policy at the start of the
        step; ``num_updates`` counts the optimizer updates taken.

        Every step also reports the drift metrics ``off_policy/*`` (rollout-vs-trainer KL, ratio quantiles,
        the shares the correction masked or truncated; ``off_policy_metrics.py``).

        With off-policy correction on, the metrics include ``is_weight_mean`` and ``is_weight_max`` (of
        ``pi_trainer / pi_behaviour`` over the loss tokens, before any cap) and ``is_truncated_fraction``
        (loss tokens above the cap: truncated by ``tis``, left out by ``decoupled``).

        Args:
            batch: the step packed by ``rollflow.orchestrator.packing.pack_batch`` for ``world_size`` ranks
                (the packer's metrics are included in the result), or this rank's share of one.
            policy_version: the version of the weights being trained; when given, the metrics include
                ``behaviour_staleness_mean``, the mean over loss tokens of ``policy_version`` minus the
                version that sampled the token (tokens of unknown version, below 0, are left out).

        Raises:
            ValueError: a sample's logprobs do not match its completion tokens, or the batch was packed for
                another number of ranks.
            TypeError: ``batch`` is not packed (a ``TrainBatch``).
        """
        started = time.perf_counter()
        # Worker threads that never set a thread count run under MKL/OpenMP dynamic threading, which is
        # measurably slower here (pytorch#13757); setting it, even to the same value, turns that off.
        torch.set_num_threads(self.config.num_threads or torch.get_num_threads())
        share, metrics = self._rank_share(batch)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]  # what this step's updates use
        micro_batches = [
            build_micro_batch(
                [item.sample for item in items],
                [item.advantage for item in items],
                pad_token_id=self.pad_token_id,
                device=self.device,
                share_prompts=self.share_prompts,
            )
            for items in share.micro_batches
        ]
        mini_batches = share.mini_batch_slices()
        counts, lag_sum, lag_count = self._step_counts(micro_batches, mini_batches, share, policy_version)
        num_loss_tokens = math.fsum(update.loss_tokens for update in counts)
        metrics["num_loss_tokens"] = num_loss_tokens
        if policy_version is not None:  # after collation, which checks each sample's lengths
            metrics["behaviour_staleness_mean"] = lag_sum / lag_count if lag_count else 0.0
        if num_loss_tokens == 0:
            log.warning("skipped optimizer step: no trainable tokens", step=share.step, **metrics)
            return self._skipped(share.step, metrics, started)

        start = self._start_of_step(micro_batches, mini_batches)
        start.meter = DriftMeter()
        if self.config.kl_in == "reward":
            metrics.update(self._kl_into_advantages(share, micro_batches, start, num_loss_tokens))
        passes: list[list[dict[str, float]]] = []
        for epoch in range(self.config.ppo_epochs):
            passes.append(
                [
                    self._update(
                        micro_batches,
                        indices,
                        update,
                        num_loss_tokens,
                        policy_version,
                        start,
                        epoch,
                        share.step,
                    )
                    for indices, update in zip(mini_batches, counts, strict=True)
                    # The counts are every rank's, so every rank skips the same mini-batches.
                    if update.loss_tokens > 0
                ]
            )
        metrics.update(updates.step_metrics(passes))
        step_sequences = math.fsum(update.sequences for update in counts)
        metrics.update(start.meter.metrics(self.parallel, self.device, num_loss_tokens, step_sequences))
        # Engine-vs-trainer mismatch is a numerical check: only samples wholly sampled by these weights count.
        onpolicy_tokens = metrics.pop("logprob_mismatch_tokens")
        mismatch_sum = metrics.pop("logprob_mismatch_sum")
        metrics["logprob_mismatch"] = mismatch_sum / onpolicy_tokens if onpolicy_tokens else math.nan
        metrics["logprob_mismatch_tokens"] = onpolicy_tokens
        if metrics["num_updates"] == 0:
            return self._skipped(share.step, metrics, started)
        self.scheduler.step()  # the schedule counts steps that updated, not their updates
        metrics["skipped_update"] = 0.0
        metrics["train_time_s"] = time.perf_counter() - started
        return StepResult(step=share.step, metrics=metrics, updated=True)

    def _step_counts(
        self,
        micro_batches: list[MicroBatch],
        mini_batches: list[range],
        share: RankBatch,
        policy_version: int | None,
    ) -> tuple[list[UpdateCounts], float, float]:
        """Each mini-batch's loss tokens and sequences over every rank (what its micro-batches divide by, so
        that their gradients add up to the update's loss however the samples were split), and the staleness
        sum and count: one reduction for all of them."""
        local: list[float] = list(_staleness_sums(share.samples, policy_version))
        for indices in mini_batches:
            shares = [update_counts(micro_batches[index].loss_mask) for index in indices]
            local += [sum(tokens for tokens, _ in shares), sum(rows for _, rows in shares)]
        step_sums = self.parallel.all_reduce(torch.tensor(local, dtype=torch.float64, device=self.device))
        lag_sum, lag_count, *rest = (float(value) for value in step_sums.cpu())
        counts = [
            UpdateCounts(loss_tokens=rest[2 * k], sequences=rest[2 * k + 1]) for k in range(len(mini_batches))
        ]
        return counts, lag_sum, lag_count

    def _start_of_step(self, micro_batches: list[MicroBatch], mini_batches: list[range]) -> updates.StepStart:
        """The policy's logprobs and entropy with the weights at the start of the step, for the micro-batches
        whose first forward comes after an update of this step (all of them when the KL goes into the
        rewards), and the reference policy's logprobs (KL penalty); no-grad forwards, before any update.
        The first mini-batch's own first forward gives its start logprobs, at no extra cost."""
        count = len(micro_batches)
        start = updates.StepStart(
            policy=[None] * count, reference=[None] * count, keep=self.config.ppo_epochs > 1
        )
        own_forward = set() if self.config.kl_in == "reward" or not mini_batches else set(mini_batches[0])
        with torch.no_grad():
            for index, micro_batch in enumerate(micro_batches):
                if index not in own_forward:
                    start.policy[index] = self._token_logprobs(self.model, micro_batch)
                if self.config.kl_coef > 0:
                    start.reference[index] = self._reference_logprobs(micro_batch)
        return start

    def _reference_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """The reference policy's logprobs (no grad): the frozen copy, or with LoRA the base itself."""
        if self.reference_model is not None:
            return self._token_logprobs(self.reference_model, micro_batch).logprobs
        from rollflow.train.lora import adapter_disabled

        with adapter_disabled(self.model):
            return self._token_logprobs(self.model, micro_batch).logprobs

    def _kl_into_advantages(
        self,
        share: RankBatch,
        micro_batches: list[MicroBatch],
        start: updates.StepStart,
        num_step_tokens: float,
    ) -> dict[str, float]:
        """``trainer.kl_in = "reward"``: each sample's reward less ``kl_coef`` times its tokens' KL (start
        weights against the reference), then its group's advantages again; replaces the micro-batches'
        advantages in place. Returns the ``kl``, ``kl_reward_penalty_mean`` and ``advantage_abs_mean`` metrics,
        the step's (every rank's samples).

        On several ranks a group's samples may sit on several of them: each rank's samples (group, trajectory,
        reward, KL sum) are gathered on every rank, which computes the whole step's advantages and keeps its own.
        """
        samples: list[Sample] = []
        kl_sums: list[float] = []
        kl_total = 0.0
        for index, (items, micro_batch) in enumerate(zip(share.micro_batches, micro_batches, strict=True)):
            policy, reference = start.policy[index], start.reference[index]
            assert policy is not None and reference is not None  # _start_of_step computed both
            per_token = kl_estimate(policy.logprobs, reference, self.config.kl_estimator)
            per_token = torch.where(micro_batch.loss_mask, per_token, torch.zeros_like(per_token))
            kl_total += float(per_token.sum())
            samples += [item.sample for item in items]
            kl_sums += per_token.sum(dim=1).tolist()[: len(items)]  # an empty micro-batch has one blank row
        offset = 0
        if self.world_size > 1:
            step_samples, step_kl_sums, offset, kl_total = self._gather_kl_samples(samples, kl_sums, kl_total)
        else:
            step_samples, step_kl_sums = samples, kl_sums
        step_advantages = kl_penalised_advantages(
            step_samples, step_kl_sums, self.config.kl_coef, self.config.advantage
        )
        advantages = step_advantages[offset : offset + len(samples)]
        first = 0
        for index, micro_batch in enumerate(micro_batches):
            rows = len(share.micro_batches[index])
            if rows:
                values = torch.tensor(
                    advantages[first : first + rows], dtype=torch.float32, device=self.device
                )
                micro_batches[index] = dataclasses.replace(
                    micro_batch,
                    advantages=torch.where(micro_batch.loss_mask, values[:, None], 0.0),
                )
            first += rows
        return {
            "kl": kl_total / num_step_tokens,
            "kl_reward_penalty_mean": self.config.kl_coef
            * math.fsum(step_kl_sums)
            / max(len(step_kl_sums), 1),
            "advantage_abs_mean": math.fsum(abs(value) for value in step_advantages)
            / max(len(step_advantages), 1),
        }

    def _gather_kl_samples(
        self, samples: list[Sample], kl_sums: list[float], kl_total: float
    ) -> tuple[list[SimpleNamespace], list[float], int, float]:
        """Every rank's samples (as what ``kl_penalised_advantages`` reads of them) and KL sums, in rank
        order; the offset of this rank's first one; the step's KL total. Two all-reduces of float64 tensors
        (exact for the indices and sums: each value comes from one rank, the others add zeros)."""
        world, rank = self.world_size, self.parallel.rank
        sizes = torch.zeros(world + 1, dtype=torch.float64, device=self.device)
        sizes[rank] = len(samples)
        sizes[world] = kl_total
        sizes = self.parallel.all_reduce(sizes).cpu()
        counts = [int(count) for count in sizes[:world]]
        offset = sum(counts[:rank])
        rows = torch.zeros((sum(counts), 4), dtype=torch.float64)
        for row, (sample, kl_sum) in enumerate(zip(samples, kl_sums, strict=True)):
            trajectory = math.nan if sample.trajectory is None else sample.trajectory
            rows[offset + row] = torch.tensor(
                [sample.prompt_index, trajectory, sample.reward, kl_sum], dtype=torch.float64
            )
        rows = self.parallel.all_reduce(rows.to(self.device)).cpu().tolist()
        gathered = [
            SimpleNamespace(
                prompt_index=int(prompt_index),
                trajectory=None if math.isnan(trajectory) else int(trajectory),
                reward=reward,
            )
            for prompt_index, trajectory, reward, _ in rows
        ]
        return gathered, [row[3] for row in rows], offset, float(sizes[world])

    def _update(
        self,
        micro_batches: list[MicroBatch],
        indices: range,
        counts: UpdateCounts,
        num_step_tokens: float,
        policy_version: int | None,
        start: updates.StepStart,
        epoch: int,
        step: int,
    ) -> dict[str, float]:
        """One optimizer update on one mini-batch (``indices`` into ``micro_batches``), skipped (gradients
        cleared, weights untouched) when its loss or gradient norm is not finite. Returns its metrics, the
        step-wide ones (``*_max``, sums over the step's tokens) already reduced over the ranks, with
        ``updated`` 1.0 or 0.0."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for index in indices:
            shares, used = self._forward_backward(
                micro_batches[index],
                counts,
                num_step_tokens,
                policy_version,
                start_policy=start.policy[index],
                reference=start.reference[index],
                first_pass=epoch == 0,
                meter=start.meter,
            )
            if start.keep:
                start.policy[index] = used  # later passes take the ratio against the same start logprobs
            for name, value in shares.items():
                if name not in totals:
                    totals[name] = value
                elif name.endswith("_max"):
                    totals[name] = torch.maximum(totals[name], value)
                else:
                    totals[name] = totals[name] + value
        self.parallel.sync_gradients(self.model.parameters())
        grad_norm = self.parallel.clip_grad_norm(self.model.parameters(), self.config.max_grad_norm)
        result = self._reduce_totals(totals)
        result["grad_norm"] = float(grad_norm)
        if not (math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            log.warning(
                "skipped optimizer update: non-finite loss or gradient norm",
                step=step,
                ppo_epoch=epoch + 1,
                loss=result["loss"],
                grad_norm=result["grad_norm"],
            )
            result["updated"] = 0.0
            return result
        self.optimizer.step()
        result["updated"] = 1.0
        return result

    def _rank_share(self, batch: PackedBatch | RankBatch) -> tuple[RankBatch, dict[str, float]]:
        """This rank's micro-batches, and the packer's step-wide metrics when the whole batch came."""
        if isinstance(batch, RankBatch):
            return batch, {}
        if not isinstance(batch, PackedBatch):
            raise TypeError(
                f"train_step takes a PackedBatch, not {type(batch).__name__}: pack the step's groups first, "
                "e.g. rollflow.orchestrator.packing.pack_for_trainer(batch, trainer_config, trainer.world_size)"
            )
        if len(batch.ranks) != self.world_size:
            raise ValueError(
                f"step {batch.step} was packed for {len(batch.ranks)} ranks, but this trainer has "
                f"{self.world_size}; pack it with num_ranks = trainer.world_size"
            )
        return batch.ranks[self.parallel.rank], dict(batch.metrics)

    def _reduce_totals(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's metrics from this rank's shares: sums added over ranks, ``*_max`` maxima taken."""
        reduced: dict[str, float] = {}
        for op in ("sum", "max"):
            names = sorted(name for name in totals if name.endswith("_max") == (op == "max"))
            if names:
                values = torch.stack([totals[name].detach().float().reshape(()) for name in names])
                values = self.parallel.all_reduce(values, op=op).cpu()
                reduced.update((name, float(value)) for name, value in zip(names, values, strict=True))
        return reduced

    def _forward_backward(
        self,
        micro_batch: MicroBatch,
        counts: UpdateCounts,
        num_step_tokens: float,
        policy_version: int | None = None,
        *,
        start_policy: TokenLogprobs | None = None,
        reference: torch.Tensor | None = None,
        first_pass: bool = True,
        meter: DriftMeter | None = None,
    ) -> tuple[dict[str, torch.Tensor], TokenLogprobs]:
        """Loss and backward of one micro-batch; returns its (detached) shares of the update's metrics, and
        the start-of-step logprobs it used.

        ``start_policy`` holds the policy's logprobs and entropy at the start of the step; None when no
        update has happened yet this step, so that this very forward is the start. The loss is scaled per
        ``trainer.loss_agg`` by the update's ``counts``; the metric shares are sums divided by the step's
        token count (``*_max`` shares are maxima over the micro-batch). The first pass over the batch also
        measures the start policy: entropy, engine/trainer mismatch and importance weights.
        """
        mask = micro_batch.loss_mask
        policy = self._token_logprobs(self.model, micro_batch)
        micro_batch = self._behaviour_on_trained_support(micro_batch, policy)
        new_logprobs = policy.logprobs
        if start_policy is None:
            start_policy = TokenLogprobs(logprobs=new_logprobs.detach(), entropy=policy.entropy)
        importance = None
        if self.off_policy == "none":
            ratio_anchor, token_weights = micro_batch.old_logprobs, None
        else:
            # The proximal policy is the weights at the start of the step: in the first update, this very
            # forward (the ratio is 1 in value but carries the gradient); the stale part goes into the weights.
            ratio_anchor = start_policy.logprobs
            importance = behaviour_correction(ratio_anchor, micro_batch.old_logprobs, mask, self.correction)
            token_weights = importance.weights
        result = policy_loss(
            new_logprobs,
            ratio_anchor,
            micro_batch.advantages,
            mask,
            clip_low=self.config.clip_low,
            clip_high=self.config.clip_high,
            num_step_tokens=num_step_tokens,
            ref_logprobs=reference if self.config.kl_in == "loss" else None,
            kl_coef=self.config.kl_coef,
            token_weights=token_weights,
            loss_scale=token_loss_scale(mask, self.config.loss_agg, counts, self.config.constant_norm),
            kl_estimator=self.config.kl_estimator,
            ratio_level=self.config.ratio_level,
            objective=self.config.loss,
        )
        result.loss.backward()

        with torch.no_grad():
            shares = {
                "loss": result.loss.detach(),
                "clip_fraction": result.clip_fraction,
                "ratio_mean": result.ratio_mean,
                "approx_kl": result.approx_kl,
            }
            if result.kl is not None:
                shares["kl"] = result.kl
            if first_pass and meter is not None:
                meter.add(start_policy.logprobs, micro_batch.old_logprobs, mask, importance)
            if first_pass:
                shares.update(
                    self._start_measures(
                        micro_batch, start_policy, importance, num_step_tokens, policy_version
                    )
                )
        return shares, start_policy

    def _start_measures(
        self,
        micro_batch: MicroBatch,
        start_policy: TokenLogprobs,
        importance: ImportanceWeights | None,
        num_step_tokens: float,
        policy_version: int | None,
    ) -> dict[str, torch.Tensor]:
        """Shares of the metrics of the start-of-step policy (before any update of the step)."""
        mask = micro_batch.loss_mask
        # The mismatch counts only samples these very weights sampled throughout: a token sampled after a
        # ``keep`` barrier was computed over keys and values of the older weights, which no forward of these
        # reproduces.
        on_policy = mask
        if policy_version is not None:
            other_version = mask & (micro_batch.token_versions != policy_version)
            on_policy = mask & ~other_version.any(dim=1, keepdim=True)
        mismatch = (start_policy.logprobs - micro_batch.old_logprobs)[on_policy].abs()
        shares = {
            "entropy": start_policy.entropy[mask].sum() / num_step_tokens,
            "logprob_mismatch_sum": mismatch.sum(),
            "logprob_mismatch_tokens": on_policy.sum(),
            "logprob_mismatch_max": _max_or_zero(mismatch),
        }
        if importance is not None:
            shares["is_weight_mean"] = importance.raw[mask].sum() / num_step_tokens
            shares["is_weight_max"] = _max_or_zero(importance.raw[mask])
            shares["is_truncated_fraction"] = importance.capped.sum() / num_step_tokens
        return shares

    def _token_logprobs(self, model: torch.nn.Module, micro_batch: MicroBatch) -> TokenLogprobs:
        """Logprobs and entropy on the micro-batch's loss tokens (0 elsewhere), chunked over positions, in
        the compute dtype (the backward runs outside this context, as autocast expects)."""
        with torch.autocast(
            self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32
        ):
            if self.routing_replay:
                routing_replay.set_routes(model, micro_batch.routed_experts)
            return model_token_logprobs(
                model,
                micro_batch.input_ids,
                micro_batch.attention_mask,
                temperature=self.temperature,
                chunk_tokens=self.config.logprob_chunk_tokens,
                positions=micro_batch.loss_mask,
                kept_counts=micro_batch.kept_counts,
                renormalise=self.config.sampling_mask == "replay",
                shared_prompts=micro_batch.shared_prompts,
            )

    def _behaviour_on_trained_support(self, micro_batch: MicroBatch, policy: TokenLogprobs) -> MicroBatch:
        """The micro-batch with behaviour logprobs of the distribution being trained.

        The sampler's logprobs are over its kept sets (renormalised). ``sampling_mask = "replay"`` trains the
        same renormalised distribution, so they stand. ``"ignore"`` trains the full softmax: each recorded
        logprob is moved onto it with the kept set's log mass under these weights (``policy.kept_log_mass``),
        which is exact for tokens these weights sampled and what training without masks did before.
        """
        if self.config.sampling_mask == "replay" or policy.kept_log_mass is None:
            return micro_batch
        shifted = micro_batch.old_logprobs + policy.kept_log_mass.detach()
        return dataclasses.replace(micro_batch, old_logprobs=shifted)

    def _skipped(self, step: int, metrics: dict[str, float], started: float) -> StepResult:
        metrics["skipped_update"] = 1.0
        metrics["train_time_s"] = time.perf_counter() - started
        return StepResult(step=step, metrics=metrics, updated=False)

    # ------------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every entry of the model's state dict, detached, for pushing to engines.

        Names are the Hugging Face ones; tied weights appear under both names (e.g. ``lm_head.weight`` and
        ``model.embed_tokens.weight``), sharing memory. Tensors are live views: copy them to keep a snapshot.
        With ``trainer.lora`` only the adapter: ``<module>.lora_A.weight`` and ``<module>.lora_B.weight``
        (B times the scaling; ``rollflow.train.lora.adapter_weights``), new tensors for B.
        """
        if self.lora is not None:
            from rollflow.train.lora import adapter_weights

            yield from adapter_weights(self.model)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def probe_logprobs(self, token_ids: Sequence[int], start: int = 1) -> list[float]:
        """The weights' logprob of each of ``token_ids[start:]`` after the ones before it (temperature 1): a
        probe of the values they compute, for proof of delivery to servers that report no digest of them
        (``rollflow.weights.vllm_lora``). Every rank runs the forward (a sharded model gathers its parameters).

        Raises:
            ValueError: ``start`` is not within ``1 .. len(token_ids)``.
        """
        if not 1 <= start <= len(token_ids):
            raise ValueError(f"start must be within 1 .. {len(token_ids)} (the probe's length), got {start}")
        input_ids = torch.tensor([list(token_ids)], device=self.device)
        with (
            torch.no_grad(),
            torch.autocast(
                self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32
            ),
        ):
            if self.routing_replay:
                routing_replay.set_routes(self.model, None)
            logprobs = model_token_logprobs(
                self.model,
                input_ids,
                torch.ones_like(input_ids),
                chunk_tokens=self.config.logprob_chunk_tokens,
            ).logprobs
        return logprobs[0, start - 1 :].float().cpu().tolist()

    def push_weights(self, call: Callable[[int, Iterable[tuple[str, torch.Tensor]]], Any]) -> Any:
        """Run a weight transport's ``call(rank, named_weights)`` on this rank's weights and return its result:
        the transport half of a weight transfer (``rollflow.weights.TransportCall``), which sends them to the
        inference servers. A worker group runs it in each worker, where the tensors may be shards (DTensors):
        every rank must iterate them (each ``full_tensor()`` is a collective) and rank 0 sends. Blocking: the
        weight barrier runs it in a worker thread, between training steps."""
        return call(self.parallel.rank, self.named_weights())

    def close(self) -> None:
        """Nothing to release in this process (the handle protocol's ``close``)."""


def _lr_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainerConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of ``trainer.lr_schedule``, stepped once per optimizer update: transformers'
    ``constant_with_warmup``, ``linear`` and ``cosine`` (half a cosine) schedules, the same factors and the same
    ``LambdaLR`` state in checkpoints, without importing ``transformers.optimization`` (a third of a second of
    every trainer's start, peft included).

    Raises:
        ValueError: a decaying schedule without ``total_steps``.
    """
    if config.lr_schedule != "constant" and total_steps is None:
        raise ValueError(f"trainer.lr_schedule = {config.lr_schedule!r} needs the run's number of steps")
    factor = functools.partial(
        _lr_factor, config.lr_schedule, config.warmup_steps, total_steps if total_steps is not None else 0
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _lr_factor(schedule: str, warmup: int, total: int, step: int) -> float:
    """The learning rate's multiple of ``lr`` at optimizer update ``step``: a linear warm-up from 0 over
    ``warmup`` updates, then constant, or decaying to 0 at ``total`` (linearly or along half a cosine)."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _max_or_zero(values: torch.Tensor) -> torch.Tensor:
    return values.max() if values.numel() else values.new_zeros(())


def _staleness_sums(samples: Sequence[Sample], policy_version: int | None) -> tuple[float, float]:
    """Sum and count of ``policy_version - version`` over the samples' loss tokens of known version."""
    if policy_version is None:
        return 0.0, 0.0
    lags = []
    for sample in samples:
        if len(sample.policy_versions) != len(sample.completion_token_ids):
            continue  # no per-token record to measure
        # An empty prompt leaves the first completion token out of the loss (see build_micro_batch).
        skipped = 0 if sample.prompt_token_ids else 1
        mask = [True] * len(sample.completion_token_ids) if sample.loss_mask is None else sample.loss_mask
        lags += [
            policy_version - version
            for version, trained in zip(sample.policy_versions[skipped:], mask[skipped:], strict=True)
            if trained and version >= 0
        ]
    return float(math.fsum(lags)), float(len(lags))
