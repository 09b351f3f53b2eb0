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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

OffPolicy = Literal["none", "tis", "decoupled"]


@dataclass(frozen=True)
class ImportanceWeights:
    """Per-token importance weights of one micro-batch, all detached and 1 (or False) off the loss mask."""

    weights: torch.Tensor  # what multiplies each token's PPO term: truncated (tis) or filtered (decoupled)
    raw: torch.Tensor  # exp(proximal - behaviour) before any cap
    capped: torch.Tensor  # bool: loss tokens whose raw weight is above the cap (truncated or left out)


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
