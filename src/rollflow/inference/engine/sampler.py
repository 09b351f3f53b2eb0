"""Token sampling and logprobs for one batch of rows, each with its own ``SamplingParams``.

The logprob reported for a token is ``log_softmax(logits / temperature)`` at that token, taken BEFORE top-k and
top-p filtering (temperature 0 reports plain ``log_softmax(logits)``). That is what the trainer recomputes: it
divides its logits by the same temperature and never applies top-k/top-p. With filtering on, the reported
logprob is therefore not the log-probability of the filtered distribution the token was drawn from.

Seeded requests draw from their own ``torch.Generator``, one row at a time, so their tokens depend only on their
seed, prompt and weights, never on which other requests share the batch. Unseeded rows are drawn together
from one shared generator.

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

import torch

from rollflow.messages import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [n, vocab]; return the tokens and their logprobs.

    ``generators[i]`` is row i's own generator (seeded requests) or None (draw from ``shared_generator``).
    Temperature 0 is greedy (argmax of the raw logits); top_k <= 0 and top_p = 1 disable those filters.
    """
    logits = logits.float()  # a no-op for float32 models; half-precision logits are sampled in float32
    temperatures = [p.temperature for p in params]
    if not any(temperatures):
        # All greedy: the common evaluation case, three calls.
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])
        return tokens.tolist(), logprobs[:, 0].tolist()

    if logits.device.type != "cpu":
        # On CUDA an invalid distribution is a device-side assert that ends the process, not an exception.
        return _sample(logits, params, generators, shared_generator, guarded=True)
    try:
        return _sample(logits, params, generators, shared_generator, guarded=False)
    except RuntimeError:  # torch.multinomial refused a row: inf or NaN from an overflow, or no mass left
        return _sample(logits, params, generators, shared_generator, guarded=True)


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
    *,
    guarded: bool,
) -> tuple[list[int], list[float]]:
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
        probs, order = _filtered_probs(sampled_scaled, sampled_params)
    else:
        probs, order = sampled_logprobs.exp(), None
    if guarded:
        probs = _argmax_where_massless(probs)
    picks = _draw(probs, [generators[i] for i in sampled_rows], shared_generator)
    if order is not None:
        picks = order.gather(1, picks[:, None])[:, 0]
    if sampled_index is None:
        tokens = picks
    else:
        tokens[sampled_index] = picks

    logprobs = logprobs_all.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p (vLLM's order) on temperature-scaled logits.

    Returns the renormalized probabilities in descending-logit order and that order (to map picks back).
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
    return probs, order


def _draw(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], shared_generator: torch.Generator
) -> torch.Tensor:
    """One index per row of ``probs`` (unnormalized is fine): seeded rows alone, the others in one call."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.multinomial(probs, 1, generator=shared_generator)[:, 0]
    picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for i in seeded:
        picks[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    if len(seeded) < len(generators):
        unseeded = torch.tensor([i for i, g in enumerate(generators) if g is None], device=probs.device)
        picks[unseeded] = torch.multinomial(probs[unseeded], 1, generator=shared_generator)[:, 0]
    return picks
