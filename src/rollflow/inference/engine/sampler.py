"""Token sampling and logprobs for one batch of rows, each with its own ``SamplingParams``.

The logprob reported for a token is that of the distribution it was drawn from (vLLM's ``processed_logprobs``):
``log_softmax`` of ``logits / temperature`` over the tokens top-k and top-p kept, renormalised there
(temperature 0 reports plain ``log_softmax(logits)``). The kept set of each token is recorded as one integer,
its *kept count* n: the sampler kept the n most likely tokens, ranked by scaled logit, ties broken by the lower
token id (a stable descending sort), so the trainer rebuilds the same set from its own logits and n
(``rollflow.train.losses``). 0 means nothing was cut (no top-k/top-p, or they kept the whole vocabulary).
With top-k and top-p both set, top-k applies first, then top-p on the renormalised top-k tokens (vLLM's order);
the kept set is a prefix of the same ranking either way, so one count describes the intersection.
``raw_logprobs`` reports vLLM's ``raw_logprobs`` mode instead: ``log_softmax(logits)`` before temperature and
truncation, which a trainer at any other temperature does not reproduce (kept for emulating such a server).

Each row's token is drawn by inverse transform: one uniform in [0, 1) placed on the row's cumulative mass
(float64). Seeded requests take theirs from their own ``torch.Generator``, one double a token, so their tokens
depend only on their seed, prompt and weights, never on which other requests share the batch; unseeded rows
take theirs from one shared generator in one call. (``torch.multinomial`` draws one exponential per vocabulary
entry instead: on a CPU that was most of the sampler's time.)

Numerics: probabilities are computed in float32, and every row keeps its most likely token through top-k and
top-p. Logits are divided by the temperature as they are (no extra pass) unless the draw refuses the result
(with ``torch.multinomial``'s messages): huge logits over a small temperature overflow to inf, and inf - inf is
NaN. The batch is then sampled again on logits whose row maximum was subtracted first, so the largest scaled
logit is exactly 0 and the others at most -inf, and a row that still has no finite positive mass is drawn as
its argmax. With parameters inside ``rollflow.messages.sampling_error``'s bounds and rows with a finite maximum
and no NaN (the engine fails other rows before sampling), sampling therefore never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from rollflow.messages import SamplingParams


class Sampled(NamedTuple):
    """One token per row, with its logprob and its kept count (see the module docstring)."""

    tokens: list[int]
    logprobs: list[float]
    # The sampler kept the kept_counts[i] most likely tokens of row i; 0: nothing was cut.
    kept_counts: list[int]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
    *,
    raw_logprobs: bool = False,
) -> Sampled:
    """Pick one token per row of ``logits`` [n, vocab]; return the tokens, their logprobs and kept counts.

    ``generators[i]`` is row i's own generator (seeded requests) or None (draw from ``shared_generator``).
    Temperature 0 is greedy (argmax of the raw logits); top_k <= 0 and top_p = 1 disable those filters.
    ``raw_logprobs`` reports ``log_softmax(logits)`` (vLLM's ``raw_logprobs`` mode) instead of the logprob
    of the distribution the token was drawn from.
    """
    logits = logits.float()  # a no-op for float32 models; half-precision logits are sampled in float32
    temperatures = [p.temperature for p in params]
    if not any(temperatures):
        # All greedy: the common evaluation case, three calls.
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])
        return Sampled(tokens.tolist(), logprobs[:, 0].tolist(), [0] * len(params))

    try:
        sampled = _sample(logits, params, generators, shared_generator, guarded=False)
    except RuntimeError:  # the draw refused a row: inf or NaN from an overflow, or no mass left
        sampled = _sample(logits, params, generators, shared_generator, guarded=True)
    if raw_logprobs:
        tokens = torch.tensor(sampled.tokens, device=logits.device)
        raw = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        return Sampled(sampled.tokens, raw.tolist(), sampled.kept_counts)
    return sampled


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
    *,
    guarded: bool,
) -> Sampled:
    """``sample`` for a batch with at least one sampled row; ``guarded`` subtracts each row's maximum before
    dividing by the temperature and draws rows without mass as their argmax."""
    temperatures = [p.temperature for p in params]
    if all(t == 1.0 for t in temperatures):
        scaled = logits  # log_softmax subtracts the max itself
    else:
        divisors = torch.tensor(
            [t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device
        )[:, None]
        # Guarded, (logits - max) / t <= 0: a small t sends the tail to -inf instead of the top to +inf.
        shifted = logits - logits.amax(dim=-1, keepdim=True) if guarded else logits
        scaled = shifted / divisors
    logprobs_all = torch.log_softmax(scaled, dim=-1)

    sampled_rows = [i for i, t in enumerate(temperatures) if t > 0]
    greedy_rows = [i for i, t in enumerate(temperatures) if t == 0]
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if greedy_rows:
        greedy_index = torch.tensor(greedy_rows, device=logits.device)
        tokens[greedy_index] = logits[greedy_index].argmax(dim=-1)

    if len(sampled_rows) == len(params):
        sampled_index = None
        sampled_scaled, sampled_logprobs = scaled, logprobs_all
    else:
        sampled_index = torch.tensor(sampled_rows, device=logits.device)
        sampled_scaled, sampled_logprobs = scaled[sampled_index], logprobs_all[sampled_index]
    sampled_params = [params[i] for i in sampled_rows]
    filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled_params)
    if filtered:
        probs, order, counts = _filtered_probs(sampled_scaled, sampled_params)
    else:
        probs, order, counts = sampled_logprobs.exp(), None, None
    if guarded:
        probs = _argmax_where_massless(probs)
    picks = _draw(probs, [generators[i] for i in sampled_rows], shared_generator)
    kept_counts = [0] * len(params)
    picked_logprobs = None
    if order is not None:
        # The logprob of the kept set, renormalised: log_softmax over the first ``counts`` sorted entries.
        vocab = sampled_scaled.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)
        kept_sorted = sampled_scaled.gather(1, order).masked_fill(
            ranks[None] >= counts[:, None], float("-inf")
        )
        picked_logprobs = torch.log_softmax(kept_sorted, dim=-1).gather(1, picks[:, None])[:, 0]
        picks = order.gather(1, picks[:, None])[:, 0]
        for row, count in zip(sampled_rows, counts.tolist(), strict=True):
            kept_counts[row] = count if count < vocab else 0
    if sampled_index is None:
        tokens = picks
    else:
        tokens[sampled_index] = picks

    logprobs = logprobs_all.gather(1, tokens[:, None])[:, 0]
    if picked_logprobs is not None:
        if sampled_index is None:
            logprobs = picked_logprobs
        else:
            logprobs[sampled_index] = picked_logprobs
    return Sampled(tokens.tolist(), logprobs.tolist(), kept_counts)


def _argmax_where_massless(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` with every row that has no finite positive mass (or a NaN) replaced by a one-hot at its
    largest entry, so the draw always gets a valid distribution."""
    mass = probs.sum(dim=-1)
    broken = ~(torch.isfinite(mass) & (mass > 0))
    if not bool(broken.any()):
        return probs
    rows = broken.nonzero()[:, 0]
    best = torch.nan_to_num(probs[rows], nan=-1.0, posinf=1.0).argmax(dim=-1)
    one_hot = torch.zeros_like(probs[rows])
    one_hot[torch.arange(len(rows), device=probs.device), best] = 1.0
    probs = probs.clone()
    probs[rows] = one_hot
    return probs


def _filtered_probs(
    scaled: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p (vLLM's order) on temperature-scaled logits.

    Returns the renormalized probabilities in descending-logit order, that order (to map picks back), and
    each row's kept count (the kept tokens are the first ``count`` of the order).
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scaled.device)
    ranks = torch.arange(vocab, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        # Rows without top-p get a threshold above 1 so rounding in the cumulative sum cannot drop their tail.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=scaled.device)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays, whatever rounding does
        probs = probs.masked_fill(drop, 0.0)
        # mass_before only grows along a row, so the dropped tokens are a suffix and the kept ones a prefix.
        top_k = torch.minimum(top_k, vocab - drop.sum(dim=-1))
    return probs, order, top_k.clamp(max=vocab)


def _draw(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], shared_generator: torch.Generator
) -> torch.Tensor:
    """One index per row of ``probs`` (unnormalized is fine), drawn by inverse transform: one uniform per
    row, from the row's own generator (seeded rows) or from ``shared_generator`` (the others, in one call),
    placed on the row's cumulative mass in float64.

    A seeded row's token therefore depends only on its distribution and its generator, and each draw
    advances the generator by exactly one double, whatever else shares the batch. ``torch.multinomial`` on a
    CPU draws an exponential per vocabulary entry instead (an exponential race): 206,720 of them for 128 rows
    of the tiny model's vocabulary, ~3.4 ms a step, against ~0.1 ms for the cumulative sum and the search.

    Raises:
        RuntimeError: a row with an inf, a NaN or a negative entry, or without mass (``torch.multinomial``'s
            messages; ``sample`` then retries on guarded logits).
    """
    if not bool(((probs.max() < float("inf")) & (probs.min() >= 0)).item()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    cumulative = probs.to(torch.float64).cumsum(dim=-1)
    totals = cumulative[:, -1:]
    if bool((totals == 0).any().item()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    uniforms = _uniforms(generators, shared_generator, probs.device)
    # right=True: the first entry whose cumulative mass exceeds the target, so an entry without mass (its
    # cumulative mass equal to the one before) is never picked.
    picks = torch.searchsorted(cumulative, uniforms[:, None] * totals, right=True)[:, 0]
    picks.clamp_(max=probs.shape[-1] - 1)
    # u * total may round up to the total itself (u just below 1): that lands past the last entry with mass.
    past = probs.gather(1, picks[:, None])[:, 0] <= 0
    if bool(past.any().item()):
        last_with_mass = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        picks = torch.where(past, last_with_mass, picks)
    return picks


def _uniforms(
    generators: Sequence[torch.Generator | None], shared_generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: from ``generators[i]``, or from the shared generator."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.rand(len(generators), generator=shared_generator, dtype=torch.float64, device=device)
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=device)
    rows = uniforms.unbind(0)
    for i in seeded:
        rows[i].uniform_(generator=generators[i])
    if len(seeded) < len(generators):
        unseeded = torch.tensor([i for i, g in enumerate(generators) if g is None], device=device)
        uniforms[unseeded] = torch.rand(
            len(unseeded), generator=shared_generator, dtype=torch.float64, device=device
        )
    return uniforms
