"""How an update's per-token terms become its loss (``trainer.loss_agg``), and the KL estimators.

Loss aggregation is a per-token scale: the update's loss is ``sum(scale * per_token_loss)`` over the loss
tokens of every micro-batch of its mini-batch on every rank, so splitting a mini-batch into micro-batches or
across ranks never changes it. Each scale divides by counts of the whole mini-batch (``UpdateCounts``, summed
over the ranks), never by a rank's or a micro-batch's own:

- ``token_mean``: ``1 / T`` with ``T`` the mini-batch's loss tokens. Every token weighs the same (DAPO,
  Yu et al. 2025, "token-level policy gradient loss").
- ``seq_mean_token_mean``: ``1 / (n_i * S)`` with ``n_i`` the loss tokens of token i's sequence and ``S`` the
  mini-batch's sequences (with at least one loss token): the mean over sequences of each sequence's token
  mean, as in the GRPO paper (Shao et al. 2024). Tokens of short sequences weigh more.
- ``seq_mean_token_sum``: ``1 / S``: the mean over sequences of each sequence's token sum.
- ``constant``: ``1 / (S * C)`` with ``C = trainer.constant_norm``: each sequence's token sum divided by a
  constant, then the mean over sequences. This is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
  Training"), whose code replaces GRPO's per-sequence ``mask.sum()`` by ``MAX_TOKENS`` (the generation
  budget) so that no length biases the gradient. Departs from it only in that ``S`` counts the sequences
  trained (masked ones are left out of the batch), not the ones generated.

KL estimators follow Schulman, "Approximating KL divergence" (2020), with ``log_ratio = log pi - log pi_ref``
of the sampled token: ``k1 = log_ratio``, ``k2 = log_ratio**2 / 2``, ``k3 = exp(-log_ratio) + log_ratio - 1``
(what the GRPO paper adds to its loss), and ``low_var_k3``: verl's ``low_var_kl``, k3 with ``log_ratio``
clamped to [-20, 20] and the estimate to [-10, 10].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
KlEstimator = Literal["k1", "k2", "k3", "low_var_k3"]


@dataclass(frozen=True)
class UpdateCounts:
    """Counts of one update's mini-batch over every rank: what each of its micro-batches divides by."""

    loss_tokens: float
    sequences: float  # sequences with at least one loss token


def token_loss_scale(
    loss_mask: torch.Tensor, agg: LossAgg, counts: UpdateCounts, constant_norm: float | None = None
) -> torch.Tensor:
    """The factor of each token's loss term under ``agg`` (0 off the mask), float32, shape of ``loss_mask``.

    ``loss_mask`` is ``[batch, time]``, one row per sequence. Summed over the update's micro-batches and
    ranks, ``scale * per_token_loss`` gives the update's loss (see the module docstring).

    Raises:
        ValueError: an unknown ``agg``, or ``constant`` without a positive ``constant_norm``.
    """
    mask = loss_mask.bool().float()
    tokens, sequences = max(counts.loss_tokens, 1.0), max(counts.sequences, 1.0)
    if agg == "token_mean":
        return mask / tokens
    if agg == "seq_mean_token_mean":
        row_tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / (row_tokens * sequences)
    if agg == "seq_mean_token_sum":
        return mask / sequences
    if agg == "constant":
        if constant_norm is None or not constant_norm > 0:
            raise ValueError(
                f"trainer.loss_agg = 'constant' needs trainer.constant_norm > 0 (got {constant_norm!r})"
            )
        return mask / (sequences * constant_norm)
    raise ValueError(
        f"unknown trainer.loss_agg {agg!r}; use 'token_mean', 'seq_mean_token_sum', "
        "'seq_mean_token_mean' or 'constant'"
    )


def update_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """This micro-batch's share of ``UpdateCounts``: its loss tokens and its rows with any."""
    mask = loss_mask.bool()
    return int(mask.sum()), int(mask.any(dim=-1).sum())


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs, differentiable in both.

    Raises:
        ValueError: an unknown ``estimator``.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # r - log r - 1 with r = pi_ref / pi: never negative.
        return torch.exp(-log_ratio) + log_ratio - 1.0
    if estimator == "low_var_k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown trainer.kl_estimator {estimator!r}; use 'k1', 'k2', 'k3' or 'low_var_k3'")
