"""The drift metrics of every step: how far the sampler's policy is from the trainer's, and what the
behaviour correction (``off_policy.py``) did about it.

All are over the step's loss tokens, with ``delta_t = log pi_trainer(t) - log pi_behaviour(t)`` of each
sampled token, the trainer's logprobs being those at the start of the step (before any update):

- ``off_policy/kl_k1``, ``off_policy/kl_k3``: KL(pi_behaviour || pi_trainer) estimated on the sampled tokens
  (Schulman's k1 ``-delta`` and k3 ``exp(delta) - 1 - delta``), staleness and numerical mismatch together;
- ``off_policy/ratio_p1``, ``_p50``, ``_p99``: quantiles of the token ratios ``exp(delta)``, exact over every
  rank (the values are gathered, not binned);
- ``off_policy/masked_token_fraction``, ``_seq_fraction`` and ``off_policy/truncated_token_fraction``,
  ``_seq_fraction``: the share of loss tokens and of sequences the correction's rule masked or truncated
  (only the action its kind takes; a sequence counts when any of its tokens was acted on).

Tokens with a non-finite behaviour logprob are left out of the KL and the quantiles (the step is skipped
for them anyway, ``off_policy.py``).
"""

from __future__ import annotations

import math

import torch

from rollflow.train.off_policy import ImportanceWeights

PREFIX = "off_policy/"
QUANTILES = ((1, 0.01), (50, 0.5), (99, 0.99))


class DriftMeter:
    """Collects a step's first-pass micro-batches (``add``), then reduces them over the ranks once
    (``metrics``). Every rank must call ``metrics``: it runs collectives."""

    def __init__(self) -> None:
        self._log_ratios: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []
        self._masking = False
        self._truncating = False

    @torch.no_grad()
    def add(
        self,
        trainer_logprobs: torch.Tensor,
        behaviour_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        importance: ImportanceWeights | None,
    ) -> None:
        """One micro-batch's ``[batch, time]`` start-of-step and behaviour logprobs, its loss mask and the
        correction's weights (None without a correction)."""
        mask = loss_mask.bool()
        delta = (trainer_logprobs - behaviour_logprobs).double()
        finite = mask & torch.isfinite(delta)
        values = delta[finite]
        self._log_ratios.append(values.cpu())
        zero = delta.new_zeros(())
        masked_tokens = masked_rows = truncated_tokens = truncated_rows = zero
        if importance is not None and importance.masked is not None:
            self._masking = True
            masked_tokens = importance.masked.sum().double()
            masked_rows = importance.masked.any(dim=-1).sum().double()
        if importance is not None and importance.truncated is not None:
            self._truncating = True
            truncated_tokens = importance.truncated.sum().double()
            truncated_rows = importance.truncated.any(dim=-1).sum().double()
        self._sums.append(
            torch.stack(
                [
                    (-values).sum(),
                    (torch.expm1(values) - values).sum(),
                    torch.tensor(float(values.numel()), dtype=torch.float64, device=delta.device),
                    masked_tokens,
                    masked_rows,
                    truncated_tokens,
                    truncated_rows,
                ]
            )
            .double()
            .cpu()
        )

    def metrics(
        self, parallel, device: torch.device, num_step_tokens: float, num_step_sequences: float
    ) -> dict[str, float]:
        """The step's drift metrics over every rank (``parallel``: the trainer's ``SingleProcess`` or
        ``DataParallel``; reductions run on ``device``, the trainer's, as NCCL needs)."""
        sums = torch.stack(self._sums).sum(dim=0) if self._sums else torch.zeros(7, dtype=torch.float64)
        flags = torch.tensor([float(self._masking), float(self._truncating)], dtype=torch.float64)
        reduced = _all_reduce(parallel, torch.cat([sums, flags]), device)
        k1, k3, count, masked_tokens, masked_rows, truncated_tokens, truncated_rows = reduced[:7].tolist()
        masking, truncating = reduced[7] > 0, reduced[8] > 0
        metrics = {
            f"{PREFIX}kl_k1": k1 / count if count else math.nan,
            f"{PREFIX}kl_k3": k3 / count if count else math.nan,
        }
        ratios = _gather(
            parallel, torch.cat(self._log_ratios) if self._log_ratios else torch.zeros(0), device
        )
        for percent, quantile in QUANTILES:
            value = float(torch.quantile(ratios, quantile).exp()) if ratios.numel() else math.nan
            metrics[f"{PREFIX}ratio_p{percent}"] = value
        tokens, sequences = max(num_step_tokens, 1.0), max(num_step_sequences, 1.0)
        if masking:
            metrics[f"{PREFIX}masked_token_fraction"] = masked_tokens / tokens
            metrics[f"{PREFIX}masked_seq_fraction"] = masked_rows / sequences
        if truncating:
            metrics[f"{PREFIX}truncated_token_fraction"] = truncated_tokens / tokens
            metrics[f"{PREFIX}truncated_seq_fraction"] = truncated_rows / sequences
        return metrics


def _all_reduce(parallel, values: torch.Tensor, device) -> torch.Tensor:
    return parallel.all_reduce(values.to(device)).cpu()


def _gather(parallel, values: torch.Tensor, device) -> torch.Tensor:
    """Every rank's ``values`` (1-D float64), in rank order: two sum all-reduces (sizes, then each rank's
    values at its offset of a zeroed tensor; exact, the other ranks add zeros)."""
    world, rank = getattr(parallel, "world_size", 1), getattr(parallel, "rank", 0)
    if world == 1:
        return values.double()
    sizes = torch.zeros(world, dtype=torch.float64)
    sizes[rank] = values.numel()
    sizes = _all_reduce(parallel, sizes, device)
    counts = [int(size) for size in sizes.tolist()]
    offset = sum(counts[:rank])
    gathered = torch.zeros(sum(counts), dtype=torch.float64)
    gathered[offset : offset + values.numel()] = values.double()
    return _all_reduce(parallel, gathered, device)
