"""Off-policy correction: importance weights from the behaviour policy to the trainer's proximal policy.

Three policies meet in a step. The *behaviour* policy sampled the tokens; its logprob of each token is
recorded by the sampler (``Sample.logprobs``), and in a fully-async run the tokens of one trajectory may
come from several policy versions. The *proximal* policy is the trainer's weights at the start of the step.
``pi_theta`` is the policy being optimised. With ``r = pi_theta / pi_proximal`` and
``w = pi_proximal / pi_behaviour``, the per-token loss (``trainer.off_policy``) is:

- ``none``: ``-min(r_b A, clip(r_b) A)`` with ``r_b = pi_theta / pi_behaviour``; no correction.
- ``tis``: ``-sg[min(w, C)] * min(r A, clip(r) A)`` where ``C`` is ``trainer.tis_cap`` (truncated IS).
- ``decoupled``: ``-sg[w] * min(r A, clip(r) A)``; with ``trainer.decoupled_cap`` set, a token whose ``w``
  is above the cap gets weight 0 (decoupled PPO, Fu et al. 2025, "AReaL").

The table form (``[trainer.off_policy]``, ``kind`` / ``level`` / ``low`` / ``high``; ``behaviour_correction``)
shapes ``w`` in the other ways the field uses, each against the same proximal policy. With ``w_t`` the token
weight, a sequence's ``w_seq = prod_t w_t`` and its geometric mean ``w_geo = exp(mean_t log w_t)``:

- ``tis`` at ``token`` level: ``min(w_t, high)`` (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"); at ``sequence`` level ``min(w_seq, high)`` on every token of the
  sequence (Seq-TIS; Liu, Li et al. 2025, "When Speed Kills Stability", and verl's rollout correction).
- ``mis``: masked IS, ``w * 1[low <= w <= high]`` with ``w`` the token's ``w_t`` (``token``) or its
  sequence's ``w_seq`` (``sequence``, Seq-MIS in Liu, Li et al.); at ``geometric`` level a sequence whose
  ``w_geo`` leaves the bounds is dropped and the others keep weight 1 (verl's geometric rejection sampling,
  Geo-RS: a geometric mean is a length-free measure of drift, not an importance weight).
- ``icepop``: ``w_t * 1[low <= w_t <= high]`` with IcePop's ``low = 0.5``, ``high = 5`` (Ling team 2025,
  "Every Step Evolves", Ring-1T): the same rule as token ``mis``, under its own name and defaults.

Where this departs from the papers:

- The proximal policy costs as few extra forward passes as it can. AReaL recomputes proximal logprobs over
  the batch before its minibatch updates, and the TIS write-up (Yao et al. 2025) recomputes ``pi_old`` on the
  trainer. Here the first update of a step runs with the weights at its start, so the proximal logprobs of
  its micro-batches are that forward's own, detached (``r`` is exactly 1 in value and carries the gradient,
  ``grad r = grad log pi_theta``); only the micro-batches of later mini-batches (``trainer.mini_batches``)
  get a no-grad forward before the first update. Later passes (``trainer.ppo_epochs``) reuse them all, so
  ``r`` and ``w`` of every update of a step are against the same proximal policy, and from the second
  update on the clip around it binds (``updates.py``). With one update per step it never does.
- Weights are per token, never per sequence. A trajectory whose tokens came from different policy versions
  is weighted segment by segment through each token's own behaviour logprob; ``Sample.policy_versions``
  only feeds the staleness metric.
- ``tis`` truncates (``min(w, C)``: biased, bounded). ``decoupled``'s cap filters instead, as AReaL's
  ``behav_imp_weight_cap`` does; a filtered token stays in the step's token-mean denominator.
- A non-finite behaviour logprob gives a NaN weight rather than one truncated to ``C``, so the trainer
  skips the step (as for any non-finite loss) instead of training on a corrupt record.
- Only the policy-gradient term is weighted; the KL penalty to the reference policy is not.
- Masked tokens and sequences (``mis``, ``icepop``, ``decoupled``'s filter) get weight 0 but stay in the
  loss denominators (``trainer.loss_agg``), as AReaL's filter does; verl's rejection sampling takes them out
  of the denominators too. Masking here lowers the update's size instead of reweighting the kept tokens.
- Sequence products are taken in log space with the log clamped to [-20, 20] before ``exp`` (verl's safety
  bound): a long sequence's product would otherwise overflow. ``mis`` tests the clamped value.
- A masked or truncated sequence counts all its loss tokens as masked or truncated in the metrics
  (``off_policy_metrics.py``); a token rule counts a sequence when any of its tokens was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from rollflow.config import OffPolicyTable

OffPolicy = Literal["none", "tis", "decoupled"]


@dataclass(frozen=True)
class ImportanceWeights:
    """Per-token importance weights of one micro-batch, all detached and 1 (or False) off the loss mask."""

    weights: torch.Tensor  # what multiplies each token's PPO term: truncated (tis) or filtered (decoupled)
    raw: torch.Tensor  # exp(proximal - behaviour) before any cap
    capped: torch.Tensor  # bool: loss tokens whose raw weight is above the cap (truncated or left out)
    # bool: loss tokens given weight 0 by a mask (their own ratio's, or their sequence's); None: no mask rule
    masked: torch.Tensor | None = None
    # bool: loss tokens whose weight was truncated (their own, or their sequence's); None: no truncation rule
    truncated: torch.Tensor | None = None


@torch.no_grad()
def importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    method: Literal["tis", "decoupled"],
    cap: float | None,
) -> ImportanceWeights:
    """Importance weights ``pi_proximal / pi_behaviour`` of each loss token, capped per ``method``.

    Args:
        proximal_logprobs: the trainer's logprobs of the sampled tokens at the start of the step.
        behaviour_logprobs: the sampler's recorded logprobs of the same tokens (each from its own version).
        loss_mask: bool, true at the tokens trained on; other positions are ignored, even NaN.
        method: ``tis`` truncates weights at ``cap``; ``decoupled`` sets weights above ``cap`` to 0.
        cap: the cap; None leaves weights uncapped (only meaningful for ``decoupled``).
    """
    if method not in ("tis", "decoupled"):
        raise ValueError(f"unknown off-policy method {method!r}; use 'tis' or 'decoupled'")
    if method == "tis" and cap is None:
        raise ValueError("truncated importance sampling needs a cap (trainer.tis_cap)")
    loss_mask = loss_mask.bool()
    log_weight = proximal_logprobs - behaviour_logprobs
    # A corrupt behaviour logprob (-inf, NaN) must not hide behind the cap: NaN makes the step skip.
    log_weight = torch.where(torch.isfinite(behaviour_logprobs), log_weight, torch.nan)
    raw = torch.where(loss_mask, log_weight.exp(), 1.0)
    if cap is None:
        capped = torch.zeros_like(loss_mask)
        weights = raw
    else:
        capped = loss_mask & (raw > cap)
        weights = raw.clamp(max=cap) if method == "tis" else torch.where(capped, 0.0, raw)
    return ImportanceWeights(weights=weights, raw=raw, capped=capped)


SEQUENCE_LOG_BOUND = 20.0
"""Sequence log-weights are clamped to [-20, 20] before ``exp`` (verl's bound): about [2e-9, 5e8]."""


@torch.no_grad()
def behaviour_correction(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    correction: OffPolicyTable,
) -> ImportanceWeights:
    """The weights of ``correction`` (a ``[trainer.off_policy]`` table with its defaults filled in) for each
    loss token of ``[batch, time]`` tensors, one row per sequence (see the module docstring).

    ``raw`` is each token's own ``pi_proximal / pi_behaviour``; ``capped`` the tokens a rule acted on
    (masked or truncated). A non-finite behaviour logprob makes its token's weight NaN, and at sequence level
    its sequence's, so the step is skipped.

    Raises:
        ValueError: ``kind = "none"`` (nothing to weigh), or a kind and level no rule defines.
    """
    kind, level, low, high = correction.kind, correction.level, correction.low, correction.high
    if kind == "none":
        raise ValueError("trainer.off_policy.kind = 'none' has no importance weights")
    if kind in ("tis", "decoupled") and level == "token" and low is None:
        legacy = importance_weights(proximal_logprobs, behaviour_logprobs, loss_mask, method=kind, cap=high)
        rule = legacy.capped
        if kind == "tis":
            return ImportanceWeights(legacy.weights, legacy.raw, rule, truncated=rule)
        return ImportanceWeights(legacy.weights, legacy.raw, rule, masked=rule)
    loss_mask = loss_mask.bool()
    log_weight = proximal_logprobs - behaviour_logprobs
    log_weight = torch.where(torch.isfinite(behaviour_logprobs), log_weight, torch.nan)
    log_weight = torch.where(loss_mask, log_weight, 0.0)
    raw = torch.where(loss_mask, log_weight.exp(), 1.0)
    if level == "token":
        if kind not in ("mis", "icepop"):
            raise ValueError(f"no token rule for trainer.off_policy.kind = {kind!r} with a lower bound")
        outside = loss_mask & ((raw < low) | (raw > high))
        return ImportanceWeights(torch.where(outside, 0.0, raw), raw, outside, masked=outside)
    rows = loss_mask.any(dim=-1, keepdim=True)
    row_log = log_weight.sum(dim=-1, keepdim=True)
    if level == "geometric":
        if kind != "mis":
            raise ValueError(f"trainer.off_policy.level = 'geometric' is a mask: kind 'mis', not {kind!r}")
        counts = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        geometric = (row_log / counts).exp()
        dropped = rows & ((geometric < low) | (geometric > high))
        # NaN compares false: a corrupt sequence is not dropped, its weight stays NaN and the step skips.
        keep = torch.where(torch.isnan(geometric), torch.nan, 1.0)
        weights = torch.where(loss_mask, torch.where(dropped, 0.0, keep).expand_as(raw), 1.0)
        masked = loss_mask & dropped
        return ImportanceWeights(weights, raw, masked, masked=masked)
    if level != "sequence" or kind not in ("tis", "mis"):
        raise ValueError(f"no sequence rule for trainer.off_policy.kind = {kind!r}")
    sequence = row_log.clamp(-SEQUENCE_LOG_BOUND, SEQUENCE_LOG_BOUND).exp()
    if kind == "tis":
        acted = rows & (sequence > high)
        row_weight = sequence.clamp(max=high)
    else:
        acted = rows & ((sequence < low) | (sequence > high))
        row_weight = torch.where(acted, 0.0, sequence)
    weights = torch.where(loss_mask, row_weight.expand_as(raw), 1.0)
    flagged = loss_mask & acted
    if kind == "tis":
        return ImportanceWeights(weights, raw, flagged, truncated=flagged)
    return ImportanceWeights(weights, raw, flagged, masked=flagged)
