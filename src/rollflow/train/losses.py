"""Token-level PPO-clip policy loss with an optional k3 KL penalty, and the entropy metric.

Where this departs from the GRPO paper (Shao et al. 2024):

- Aggregation is a mean over every loss token of the whole optimizer step (DAPO's token-level mean), not a
  mean per sequence and then over the group. Each micro-batch divides its token sum by the step's token count,
  so splitting a step into micro-batches does not change the gradient.
- The clip range is ``[1 - clip_low, 1 + clip_high]``; an asymmetric range is DAPO's "clip-higher". Both are
  0.2 by default, which is the paper's symmetric clip.
- With ``trainer.off_policy = "none"``, ``pi_old`` is the sampler's recorded logprob of each token (the
  behaviour policy), so the ratio also absorbs any trainer/sampler numerical mismatch and policy staleness.
  The other settings take the ratio against the trainer's own weights and weight each token's policy term
  by an importance weight (``token_weights``; see ``off_policy.py``).
- The KL term is the paper's k3 estimator to the reference policy, added per token with weight ``kl_coef``
  and aggregated like the policy term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLoss:
    """A (micro-)batch's share of the step's token-mean loss and statistics.

    Every field is a sum over this batch's loss tokens divided by the step's token count, so summing the
    fields over a step's micro-batches gives the step's token means.
    """

    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # detached: tokens whose PPO objective was clipped
    ratio_mean: torch.Tensor  # detached: pi_new / pi_old
    kl: torch.Tensor | None  # detached k3 estimate to the reference; None without reference logprobs


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``target_ids``, in float32.

    Gathering one logit and subtracting the logsumexp avoids materialising a second vocabulary-sized
    tensor of log-probabilities.

    Args:
        logits: ``[..., vocab]``; position ``t`` must already be aligned with ``target_ids[..., t]``.
        target_ids: ``[...]`` token ids.
        temperature: the sampler's temperature, so the result is the sampling distribution's logprob.
    """
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024
) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits / temperature)`` for each row of ``[..., vocab]`` logits.

    A metric only: computed without autograd, ``chunk_rows`` rows at a time, so at most one chunk of
    vocabulary-sized probabilities exists at once.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start : start + chunk_rows].float() / temperature
        logp = torch.log_softmax(chunk, dim=-1)
        entropy[start : start + chunk_rows] = -(logp.exp() * logp).sum(dim=-1)
    return entropy.reshape(logits.shape[:-1])


def ppo_clip_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    num_step_tokens: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """Token-level PPO-clip loss ``-w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k3``.

    All tensors have the same shape (e.g. ``[batch, time]``); only positions where ``loss_mask`` is true
    count. Values at other positions are ignored entirely, even NaN.

    Args:
        new_logprobs: the policy's logprobs of the sampled tokens, with gradient.
        old_logprobs: the logprobs the ratio is taken against: the behaviour (sampler) logprobs, or the
            proximal ones (the trainer's, detached) under off-policy correction.
        advantages: each token's advantage (its sample's advantage, broadcast).
        loss_mask: bool, true at the tokens to train on.
        clip_low, clip_high: the ratio clip range ``[1 - clip_low, 1 + clip_high]``.
        num_step_tokens: loss tokens of the whole optimizer step; sums are divided by it. Defaults to this
            batch's own count (at least 1).
        ref_logprobs: reference-policy logprobs for the k3 KL estimate; None disables the KL term.
        kl_coef: weight of the KL term in the loss.
        token_weights: detached per-token weights ``w`` of the policy term (importance weights); None is 1.
    """
    loss_mask = loss_mask.bool()
    if num_step_tokens is None:
        num_step_tokens = max(int(loss_mask.sum()), 1)
    # Replace ignored positions by harmless values *before* any arithmetic: a NaN there would otherwise
    # reach the gradient through torch.where's backward (0 * NaN = NaN).
    detached_new = new_logprobs.detach()
    old_logprobs = torch.where(loss_mask, old_logprobs, detached_new)
    advantages = torch.where(loss_mask, advantages, torch.zeros_like(advantages))

    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(loss_mask, token_weights, torch.ones_like(token_weights))

    kl = None
    if ref_logprobs is not None:
        ref_logprobs = torch.where(loss_mask, ref_logprobs, detached_new)
        log_ref_ratio = ref_logprobs - new_logprobs
        # Schulman's k3 = r - log r - 1 with r = pi_ref / pi: never negative, low variance.
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = per_token + kl_coef * k3
        kl = _masked_share(k3.detach(), loss_mask, num_step_tokens)

    loss = torch.where(loss_mask, per_token, torch.zeros_like(per_token)).sum() / num_step_tokens
    return PolicyLoss(
        loss=loss,
        clip_fraction=_masked_share((clipped > unclipped).float(), loss_mask, num_step_tokens),
        ratio_mean=_masked_share(ratio.detach(), loss_mask, num_step_tokens),
        kl=kl,
    )


def _masked_share(values: torch.Tensor, mask: torch.Tensor, denominator: int) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / denominator
