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

Seeded requests draw from their own ``torch.Generator``, one row at a time, so their tokens depend only on their
seed, prompt and weights, never on which other requests share the batch: each row's draw is exactly
``torch.multinomial(row, 1, generator=its own)``, computed for the batch at once where that is proven equal
(``_draw_each``). Unseeded rows are drawn together from one shared generator.

Numerics: everything is computed in float32, and every row keeps its most likely token through top-k and
top-p. Logits are divided by the temperature as they are (the old arithmetic, bit for bit, and no extra pass)
unless ``torch.multinomial`` refuses the result: huge logits over a small temperature overflow to inf, and
inf - inf is NaN. The batch is then sampled again on logits whose row maximum was subtracted first, so the
largest scaled logit is exactly 0 and the others at most -inf, and a row that still has no finite positive mass
is drawn as its argmax. With parameters inside ``rollflow.messages.sampling_error``'s bounds and rows with a
finite maximum and no NaN (the engine fails other rows before sampling), sampling therefore never raises.
Off the CPU the guarded arithmetic is used from the start: CUDA's ``multinomial`` does not raise on an invalid
distribution, it fails a device-side assert, which ends the process.
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

    if logits.device.type != "cpu":
        # On CUDA an invalid distribution is a device-side assert that ends the process, not an exception.
        sampled = _sample(logits, params, generators, shared_generator, guarded=True)
    else:
        try:
            sampled = _sample(logits, params, generators, shared_generator, guarded=False)
        except RuntimeError:  # torch.multinomial refused a row: inf or NaN from an overflow, or no mass left
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
    largest entry, so ``torch.multinomial`` always gets a valid distribution."""
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
    """One index per row of ``probs`` (unnormalized is fine): seeded rows alone, the others in one call."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.multinomial(probs, 1, generator=shared_generator)[:, 0]
    if len(seeded) == len(generators):
        return _draw_each(probs, generators)  # type: ignore[arg-type]
    picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    seeded_index = torch.tensor(seeded, device=probs.device)
    picks[seeded_index] = _draw_each(probs[seeded_index], [generators[i] for i in seeded])  # type: ignore[misc]
    unseeded = torch.tensor([i for i, g in enumerate(generators) if g is None], device=probs.device)
    picks[unseeded] = torch.multinomial(probs[unseeded], 1, generator=shared_generator)[:, 0]
    return picks


# ------------------------------------------------------------------------------------------ seeded rows
#
# Each seeded row draws from its own generator, so ``torch.multinomial`` runs once per row: on a CPU about
# 45 us a row for the tiny model's vocabulary, half of it in the call's own checks (three reductions and
# ``.item()``s) rather than the draw, and 40% of the engine's time in the quickstart loop. ``torch.multinomial``
# draws one sample as an exponential race, ``argmax(p / q)`` with ``q = empty_like(p).exponential_(1,
# generator)`` (ATen's Distributions.cpp); ``_draw_each`` fills each row's ``q`` from that row's generator in
# the same way and does the checks, the division and the argmax once for the batch: the same tokens, and the
# generators left in the same state, as ``torch.multinomial`` row by row. Whether that holds for this torch
# build and device is checked once per (device, dtype) against ``torch.multinomial`` itself; where it does
# not, each row is drawn with ``torch.multinomial`` as before.

_RACE_MATCHES: dict[tuple[str, torch.dtype], bool] = {}


def _draw_each(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """``torch.multinomial(probs[i], 1, generator=generators[i])`` for every row i, as one tensor [n]."""
    key = (probs.device.type, probs.dtype)
    if key not in _RACE_MATCHES:
        _RACE_MATCHES[key] = _race_matches_multinomial(probs.device, probs.dtype)
    if _RACE_MATCHES[key]:
        return _exponential_race(probs, generators)
    return torch.cat(
        [torch.multinomial(row, 1, generator=g) for row, g in zip(probs.unbind(0), generators, strict=True)]
    )


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    # torch.multinomial's checks, with its messages: the caller retries guarded on this RuntimeError.
    if not bool(((probs.max() < float("inf")) & (probs.min() >= 0)).item()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(dim=-1) == 0).any().item()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    races = torch.empty_like(probs)
    for row, generator in zip(races.unbind(0), generators, strict=True):
        row.exponential_(1, generator=generator)
    return (probs / races).argmax(dim=-1)


def _race_matches_multinomial(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_exponential_race`` draws what ``torch.multinomial`` does, row by row, here: the same
    tokens over several draws (so the generators also advance alike), on rows with ties and zeros."""
    vocab = 1000
    check = torch.Generator().manual_seed(12345)
    probs = torch.rand(4, vocab, generator=check).to(device=device, dtype=dtype)
    probs[1, 10:] = 0.0  # a truncated row
    probs[2] = 1.0  # all tied
    seeds = [3, 5, 7, 11]
    theirs = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    ours = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    for _ in range(3):
        expected = [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, theirs, strict=True)]
        if _exponential_race(probs, ours).tolist() != expected:
            return False
    return True
