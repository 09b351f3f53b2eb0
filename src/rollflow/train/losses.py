"""The policy loss (PPO-clip at token or sequence level, or CISPO) with an optional KL penalty, and the
logprobs and entropy it is computed from.

Where this departs from the GRPO paper (Shao et al. 2024):

- Aggregation is by default a mean over every loss token of the update (DAPO's token-level mean), not a
  mean per sequence and then over the group; ``trainer.loss_agg`` picks another (``aggregation.py``). Each
  micro-batch's terms are scaled by counts of the whole update, so splitting it into micro-batches or across
  ranks does not change the gradient.
- The clip range is ``[1 - clip_low, 1 + clip_high]``; an asymmetric range is DAPO's "clip-higher". Both are
  0.2 by default, which is the paper's symmetric clip.
- With ``trainer.off_policy = "none"``, ``pi_old`` is the sampler's recorded logprob of each token (the
  behaviour policy), so the ratio also absorbs any trainer/sampler numerical mismatch and policy staleness.
  The other settings take the ratio against the trainer's own weights and weight each token's policy term
  by an importance weight (``token_weights``; see ``off_policy.py``).
- The KL term to the reference policy is the paper's k3 estimator by default (``trainer.kl_estimator``),
  added per token with weight ``kl_coef`` and aggregated like the policy term (or, with
  ``trainer.kl_in = "reward"``, left to the trainer, which puts it into the rewards instead).

Sequence-level ratios (``trainer.ratio_level = "sequence"``) follow GSPO (Zheng et al. 2025, "Group Sequence
Policy Optimization"): ``s_i = exp(mean_t log(pi_theta / pi_old))`` over sequence i's loss tokens, clipped per
sequence, in the paper's GSPO-token form: token t's ratio is ``sg[s_i] * pi_theta(t) / sg[pi_theta(t)]``,
equal to ``s_i`` in value, with gradient ``s_i * grad log pi_theta(t)``. Since every ``loss_agg`` weighs the
tokens of one sequence alike, this is GSPO's gradient exactly; the paper's own aggregation, a mean over
sequences, is ``loss_agg = "seq_mean_token_mean"``. Departure: the per-token importance weights of an
off-policy correction still multiply each token's term (the paper has none).

CISPO (``trainer.loss = "cispo"``; MiniMax-M1, 2025) clips the importance weight and keeps every token's
gradient: ``-sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * grad log pi_theta``. It is written as
``-sg[clip(r)] * A * exp(log pi_theta - sg[log pi_theta])``, which has that gradient and the value
``-clip(r) * A``, comparable with PPO's loss value (the paper's form, ``... * log pi_theta``, has the same
gradient and a value that is not). The paper's token-level mean is ``loss_agg = "token_mean"`` (the default).

Logprobs and entropy come from ``model_token_logprobs``: by default from the model's final hidden states and
the output-embedding weight, a chunk of positions at a time (``chunked_token_logprobs``), so the
``[batch, time, vocab]`` logits never exist at once, in the forward nor in the backward.

Sampling masks (``trainer.sampling_mask = "replay"``): where the sampler cut the vocabulary (top-k/top-p), each
token's kept count n rebuilds its kept set from the model's own logits: the n largest scaled logits, ties to
the lower token id (the sampler's stable descending sort), plus the sampled token itself (a near-tie at the
boundary that rounding ordered differently must not give it probability 0). Logprobs and entropy are those of
the softmax renormalised over that set, and its gradient is zero outside it; the reference model (KL) rebuilds
its own set of the same size. Off-policy, the set is the trained weights' top n, not necessarily the one the
older sampler kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import structlog
import torch

from rollflow.train.aggregation import KlEstimator, kl_estimate
from rollflow.train.shared_prompts import SharedPrompts

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PolicyLoss:
    """A (micro-)batch's share of the step's token-mean loss and statistics.

    Every field is a sum over this batch's loss tokens divided by the step's token count, so summing the
    fields over a step's micro-batches gives the step's token means.
    """

    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # detached: tokens whose PPO objective was clipped
    ratio_mean: torch.Tensor  # detached: pi_new / pi_old
    kl: torch.Tensor | None  # detached KL estimate to the reference; None without reference logprobs
    # detached k3 estimate of KL(pi_old || pi_new), (r - 1) - log r: how far this update moved the policy.
    approx_kl: torch.Tensor | None = None


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


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token logprobs of the target ids (with gradient) and the entropy at each position (detached)."""

    logprobs: torch.Tensor  # float32, shape of target_ids
    entropy: torch.Tensor  # float32, shape of target_ids, nats of softmax(logits / temperature)
    # Detached log of the mass the kept set holds under the full softmax (<= 0; 0 where nothing was cut);
    # None when no kept counts were given.
    kept_log_mass: torch.Tensor | None = None


def kept_set_mask(
    scaled: torch.Tensor, target_ids: torch.Tensor, kept_counts: torch.Tensor
) -> torch.Tensor | None:
    """The sampler's kept set of each row of ``scaled`` [rows, vocab] logits, rebuilt from its kept count.

    Row i keeps its ``kept_counts[i]`` largest entries (a stable descending sort: ties go to the lower token
    id, as in the sampler) and its target token; a count of 0 (or >= vocab) keeps the whole row. Returns a
    bool mask, or None when no row is cut.
    """
    vocab = scaled.shape[-1]
    cut = (kept_counts > 0) & (kept_counts < vocab)
    if not bool(cut.any()):
        return None
    counts = torch.where(cut, kept_counts, vocab)
    order = scaled.detach().sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(vocab, device=scaled.device)
    kept = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
    kept.scatter_(-1, order, ranks[None] < counts[:, None])
    kept.scatter_(-1, target_ids[:, None], True)
    return kept


class _ChunkedLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)`` at the targets, ``chunk_rows`` rows at a time.

    The forward keeps only each row's logsumexp; the backward recomputes each chunk's logits and turns
    them into that chunk's gradient, so at most one chunk of vocabulary-sized tensors exists at any time.
    Matmuls run in ``compute_dtype`` (autocast's dtype when the caller runs under autocast, as the plain
    ``lm_head`` would), softmax arithmetic in float32; the weight gradient accumulates in float32.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, target_ids, temperature, chunk_rows, compute_dtype, kept_counts, renormalise
    ):
        rows = hidden.shape[0]
        logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        logsumexp = torch.empty_like(logprobs)
        kept_log_mass = torch.zeros_like(logprobs)
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(compute_dtype)
            for start in range(0, rows, chunk_rows):
                end = min(start + chunk_rows, rows)
                logits = _chunk_logits(hidden[start:end], cast_weight, temperature, compute_dtype)
                chunk_lse = torch.logsumexp(logits, dim=-1)
                kept = None
                if kept_counts is not None:
                    kept = kept_set_mask(logits, target_ids[start:end], kept_counts[start:end])
                if kept is not None:
                    kept_lse = torch.logsumexp(logits.masked_fill(~kept, float("-inf")), dim=-1)
                    kept_log_mass[start:end] = kept_lse - chunk_lse
                    if renormalise:
                        chunk_lse = kept_lse
                logsumexp[start:end] = chunk_lse
                logprobs[start:end] = logits.gather(-1, target_ids[start:end, None]).squeeze(-1) - chunk_lse
                # H = lse - sum(p * z); the dot product as a batched matmul makes no third [rows, vocab] tensor.
                probs = (logits - chunk_lse[:, None]).exp_()
                if kept is not None and renormalise:
                    probs.masked_fill_(~kept, 0.0)
                entropy[start:end] = chunk_lse - (probs[:, None, :] @ logits[:, :, None]).reshape(-1)
                del logits, probs, kept
        ctx.save_for_backward(hidden, weight, target_ids, logsumexp, kept_counts if renormalise else None)
        ctx.temperature, ctx.chunk_rows, ctx.compute_dtype = temperature, chunk_rows, compute_dtype
        ctx.mark_non_differentiable(entropy, kept_log_mass)
        return logprobs, entropy, kept_log_mass

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, _grad_kept_log_mass):
        hidden, weight, target_ids, logsumexp, kept_counts = ctx.saved_tensors
        temperature, chunk_rows, compute_dtype = ctx.temperature, ctx.chunk_rows, ctx.compute_dtype
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(compute_dtype)
            for start in range(0, hidden.shape[0], chunk_rows):
                end = min(start + chunk_rows, hidden.shape[0])
                logits = _chunk_logits(hidden[start:end], cast_weight, temperature, compute_dtype)
                grad = grad_logprobs[start:end, None].float()
                # d logprob / d z = onehot(target) - softmax(z), with z = logits / temperature; renormalised
                # over a kept set, the softmax is the kept set's and 0 outside it.
                grad_logits = (logits - logsumexp[start:end, None]).exp_().mul_(-grad)
                if kept_counts is not None:
                    kept = kept_set_mask(logits, target_ids[start:end], kept_counts[start:end])
                    if kept is not None:
                        grad_logits.masked_fill_(~kept, 0.0)
                    del kept
                grad_logits.scatter_add_(-1, target_ids[start:end, None], grad)
                if temperature != 1.0:
                    grad_logits.div_(temperature)
                del logits
                grad_logits = grad_logits.to(compute_dtype)
                if want_hidden:
                    grad_hidden[start:end] = grad_logits @ cast_weight
                if want_weight:
                    chunk_hidden = hidden[start:end].to(compute_dtype)
                    if compute_dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.T, chunk_hidden)
                    else:
                        grad_weight += grad_logits.T @ chunk_hidden
                del grad_logits
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_logits(hidden, weight, temperature: float, compute_dtype: torch.dtype) -> torch.Tensor:
    logits = (hidden.to(compute_dtype) @ weight.T).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    kept_counts: torch.Tensor | None = None,
    renormalise: bool = True,
) -> TokenLogprobs:
    """Logprobs and entropy of ``softmax(hidden @ weight.T / temperature)`` without the full logits.

    Equal to ``token_logprobs(hidden @ weight.T, target_ids, temperature)`` and ``entropy_from_logits`` of
    the same logits, but only ``chunk_tokens`` positions' logits exist at once, in the forward and in the
    backward (which recomputes them). Gradients flow to ``hidden`` and ``weight``; the entropy is detached.

    Args:
        hidden: ``[..., hidden_size]`` final hidden states (after the last norm), position-aligned with
            ``target_ids``.
        weight: ``[vocab, hidden_size]`` output-embedding (``lm_head``) weight, without bias.
        target_ids: ``[...]`` token ids.
        temperature: the sampler's temperature.
        chunk_tokens: positions per chunk (>= 1).
        kept_counts: ``[...]`` long, the sampler's kept count of each target (0: nothing cut), or None.
        renormalise: with ``kept_counts``, the softmax is renormalised over each kept set (``kept_set_mask``);
            False keeps the full softmax and only reports ``kept_log_mass``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens = {chunk_tokens} must be >= 1")
    device_type = hidden.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    )
    shape = target_ids.shape
    logprobs, entropy, kept_log_mass = _ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target_ids.reshape(-1),
        float(temperature),
        int(chunk_tokens),
        compute_dtype,
        None if kept_counts is None else kept_counts.reshape(-1),
        bool(renormalise),
    )
    return TokenLogprobs(
        logprobs=logprobs.reshape(shape),
        entropy=entropy.reshape(shape),
        kept_log_mass=None if kept_counts is None else kept_log_mass.reshape(shape),
    )


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    positions: torch.Tensor | None = None,
    kept_counts: torch.Tensor | None = None,
    renormalise: bool = True,
    shared_prompts: SharedPrompts | None = None,
    **forward_kwargs: Any,
) -> TokenLogprobs:
    """The model's logprob of each next token ``input_ids[:, 1:]``, and its entropy there.

    Position ``i`` of the results describes the token at input position ``i + 1`` (shape
    ``[batch, time - 1]``). With ``chunk_tokens > 0`` the model's forward stops at the final hidden states
    (``output_hidden_states``, with ``logits_to_keep=1`` so its own ``lm_head`` projects one position) and
    ``chunked_token_logprobs`` projects them; the call still goes through the model's own ``forward``, so
    wrappers that hook it (FSDP) see it. ``chunk_tokens = 0`` computes the full logits, as ``lm_head`` does.
    Models whose logits are not a plain bias-free projection of the last hidden state (soft-capping, logit
    scaling, an ``lm_head`` bias) always take the full-logits path.

    Args:
        model: a Hugging Face causal LM.
        input_ids, attention_mask: ``[batch, time]``.
        temperature: the sampler's temperature.
        chunk_tokens: positions per chunk of logits; 0 disables chunking.
        positions: optional ``[batch, time - 1]`` bool mask of the positions wanted (e.g. the loss mask);
            only those are projected, the others are 0 in both results.
        kept_counts: optional ``[batch, time - 1]`` long, the sampler's kept count of each next token (0:
            nothing cut); see the module docstring.
        renormalise: with ``kept_counts``, renormalise over the kept sets (else only report their mass).
        shared_prompts: the packed layout of the same rows (``shared_prompts.py``): the forward runs that
            instead, each shared prompt once; the results are the same up to float rounding.
        forward_kwargs: passed on to the model's forward.
    """
    targets = input_ids[:, 1:]
    if shared_prompts is not None:
        inputs = {
            "input_ids": shared_prompts.input_ids,
            "attention_mask": shared_prompts.attention_mask,
            "position_ids": shared_prompts.position_ids,
        }
        unpack = shared_prompts.unpack
    else:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        unpack = _unchanged
    if chunk_tokens > 0 and _plain_projection(model):
        output = model(
            **inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1, **forward_kwargs
        )
        hidden = unpack(output.hidden_states[-1])[:, :-1]
        weight = model.get_output_embeddings().weight
        masking = {"kept_counts": kept_counts, "renormalise": renormalise}
        if positions is None:
            return chunked_token_logprobs(
                hidden, weight, targets, temperature=temperature, chunk_tokens=chunk_tokens, **masking
            )
        if kept_counts is not None:
            masking["kept_counts"] = kept_counts[positions]
        picked = chunked_token_logprobs(
            hidden[positions],
            weight,
            targets[positions],
            temperature=temperature,
            chunk_tokens=chunk_tokens,
            **masking,
        )
        return TokenLogprobs(
            logprobs=_scatter(picked.logprobs, positions),
            entropy=_scatter(picked.entropy, positions),
            kept_log_mass=None if kept_counts is None else _scatter(picked.kept_log_mass, positions),
        )
    output = model(**inputs, use_cache=False, **forward_kwargs)
    # Drop the last position: it predicts a token after the sequence, which has no target.
    logits = unpack(output.logits)[:, :-1]
    if kept_counts is not None:
        return _kept_set_logprobs(logits, targets, temperature, kept_counts, renormalise, positions)
    logprobs = token_logprobs(logits, targets, temperature)
    if positions is None:
        return TokenLogprobs(logprobs=logprobs, entropy=entropy_from_logits(logits.detach(), temperature))
    logprobs = torch.where(positions, logprobs, torch.zeros_like(logprobs))
    entropy = _scatter(entropy_from_logits(logits.detach()[positions], temperature), positions)
    return TokenLogprobs(logprobs=logprobs, entropy=entropy)


def _kept_set_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    kept_counts: torch.Tensor,
    renormalise: bool,
    positions: torch.Tensor | None,
) -> TokenLogprobs:
    """``model_token_logprobs`` on full logits with kept counts: the plain autograd form of what
    ``chunked_token_logprobs`` computes (masked entries are -inf, so their gradient is 0)."""
    if positions is None:
        positions = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
    scaled = logits[positions].float() / temperature
    picked_targets = targets[positions]
    full_lse = torch.logsumexp(scaled, dim=-1)
    kept = kept_set_mask(scaled, picked_targets, kept_counts[positions])
    masked = scaled if kept is None else scaled.masked_fill(~kept, float("-inf"))
    kept_lse = torch.logsumexp(masked, dim=-1)
    trained = masked if renormalise else scaled
    lse = kept_lse if renormalise else full_lse
    logprobs = trained.gather(-1, picked_targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():
        probs = (trained - lse[:, None]).exp()
        entropy = lse - (probs * scaled).sum(dim=-1)
    return TokenLogprobs(
        logprobs=_scatter(logprobs, positions),
        entropy=_scatter(entropy, positions),
        kept_log_mass=_scatter((kept_lse - full_lse).detach(), positions),
    )


def _unchanged(values: torch.Tensor) -> torch.Tensor:
    return values


def _scatter(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values`` of the true ``positions``, zeros elsewhere (differentiable in ``values``)."""
    return torch.zeros(positions.shape, dtype=values.dtype, device=values.device).masked_scatter(
        positions, values
    )


_warned_full_logits: set[str] = set()


def _plain_projection(model: torch.nn.Module) -> bool:
    """Whether the logits are ``last_hidden_state @ lm_head.weight.T`` and nothing else."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    extra = [
        name
        for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
        if getattr(config, name, None) not in (None, 1, 1.0)
    ]
    if isinstance(head, torch.nn.Linear) and head.bias is None and not extra:
        return True
    kind = type(model).__name__
    if kind not in _warned_full_logits:
        _warned_full_logits.add(kind)
        log.warning(
            "logits of this model are not a plain projection; computing full logits (no chunking)",
            model=kind,
            reasons=extra or ["output embedding is not a bias-free Linear"],
        )
    return False


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


RatioLevel = Literal["token", "sequence"]
Objective = Literal["ppo_clip", "cispo"]


def sequence_log_ratio(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's log ratio of ``[batch, time]`` tensors (one row per sequence): each loss token's value is
    its row's mean ``log pi_theta - log pi_old`` over the loss tokens, its gradient that of its own
    ``log pi_theta`` (see the module docstring). Positions off the mask must hold finite values."""
    loss_mask = loss_mask.bool()
    token = torch.where(loss_mask, (new_logprobs - old_logprobs).detach(), 0.0)
    mean = token.sum(dim=-1, keepdim=True) / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return mean + (new_logprobs - new_logprobs.detach())


def ppo_clip_loss(*args: Any, **kwargs: Any) -> PolicyLoss:
    """``policy_loss`` with the PPO-clip objective (the same arguments)."""
    return policy_loss(*args, objective="ppo_clip", **kwargs)


def policy_loss(
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
    loss_scale: torch.Tensor | None = None,
    kl_estimator: KlEstimator = "k3",
    ratio_level: RatioLevel = "token",
    objective: Objective = "ppo_clip",
) -> PolicyLoss:
    """The policy loss ``w * L(r, A) + kl_coef * KL`` of each loss token, aggregated.

    ``L`` is PPO-clip's ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` or CISPO's
    ``-sg[clip(r)] A exp(logp - sg[logp])``; ``r`` is each token's ratio, or with ``ratio_level =
    "sequence"`` its sequence's (GSPO; the tensors are then ``[batch, time]``, one row per sequence). All
    tensors have the same shape; only positions where ``loss_mask`` is true count. Values at other positions
    are ignored entirely, even NaN.

    Args:
        new_logprobs: the policy's logprobs of the sampled tokens, with gradient.
        old_logprobs: the logprobs the ratio is taken against: the behaviour (sampler) logprobs, or the
            proximal ones (the trainer's, detached) under off-policy correction.
        advantages: each token's advantage (its sample's advantage, broadcast).
        loss_mask: bool, true at the tokens to train on.
        clip_low, clip_high: the ratio clip range ``[1 - clip_low, 1 + clip_high]``.
        num_step_tokens: loss tokens the statistics are token means over; sums are divided by it, and so is
            the loss without ``loss_scale``. Defaults to this batch's own count (at least 1).
        ref_logprobs: reference-policy logprobs for the KL estimate; None disables the KL term.
        kl_coef: weight of the KL term in the loss.
        token_weights: detached per-token weights ``w`` of the policy term (importance weights); None is 1.
        loss_scale: per-token factors of the loss (``aggregation.token_loss_scale``); None is
            ``1 / num_step_tokens`` on every token.
        kl_estimator: ``k1``, ``k2``, ``k3`` or ``low_var_k3`` (``aggregation.kl_estimate``).
        ratio_level: ``token`` or ``sequence`` (GSPO).
        objective: ``ppo_clip`` or ``cispo``.

    Raises:
        ValueError: an unknown ``ratio_level`` or ``objective``, or CISPO at sequence level.
    """
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown trainer.ratio_level {ratio_level!r}; use 'token' or 'sequence'")
    if objective not in ("ppo_clip", "cispo"):
        raise ValueError(f"unknown trainer.loss {objective!r}; use 'ppo_clip' or 'cispo'")
    if objective == "cispo" and ratio_level != "token":
        raise ValueError("trainer.loss = 'cispo' takes token ratios (trainer.ratio_level = 'token')")
    loss_mask = loss_mask.bool()
    if num_step_tokens is None:
        num_step_tokens = max(int(loss_mask.sum()), 1)
    # Replace ignored positions by harmless values *before* any arithmetic: a NaN there would otherwise
    # reach the gradient through torch.where's backward (0 * NaN = NaN).
    detached_new = new_logprobs.detach()
    old_logprobs = torch.where(loss_mask, old_logprobs, detached_new)
    advantages = torch.where(loss_mask, advantages, torch.zeros_like(advantages))

    if ratio_level == "sequence":
        log_ratio = sequence_log_ratio(new_logprobs, old_logprobs, loss_mask)
    else:
        log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    bounded = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    if objective == "cispo":
        per_token = -advantages * bounded.detach() * torch.exp(new_logprobs - detached_new)
        clipped_tokens = (bounded != ratio).detach()
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * bounded
        per_token = torch.maximum(unclipped, clipped)
        clipped_tokens = clipped > unclipped
    if token_weights is not None:
        per_token = per_token * torch.where(loss_mask, token_weights, torch.ones_like(token_weights))

    kl = None
    if ref_logprobs is not None:
        ref_logprobs = torch.where(loss_mask, ref_logprobs, detached_new)
        penalty = kl_estimate(new_logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * penalty
        kl = _masked_share(penalty.detach(), loss_mask, num_step_tokens)

    masked = torch.where(loss_mask, per_token, torch.zeros_like(per_token))
    loss = masked.sum() / num_step_tokens if loss_scale is None else (masked * loss_scale).sum()
    token_log_ratio = (detached_new - old_logprobs).detach()
    return PolicyLoss(
        loss=loss,
        clip_fraction=_masked_share(clipped_tokens.float(), loss_mask, num_step_tokens),
        ratio_mean=_masked_share(ratio.detach(), loss_mask, num_step_tokens),
        kl=kl,
        approx_kl=_masked_share(torch.expm1(token_log_ratio) - token_log_ratio, loss_mask, num_step_tokens),
    )


def _masked_share(values: torch.Tensor, mask: torch.Tensor, denominator: int) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / denominator
