"""The draw: one uniform per row placed on the row's cumulative mass. Its tokens follow the distribution and
never land on an entry without mass, rounding at the very top included; a seeded row's tokens depend only on
its generator and distribution, whatever shares the batch, and each draw advances the generator by one
double; an invalid row raises as ``torch.multinomial`` does (the sampler then retries on guarded logits)."""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.inference.engine import sampler

VOCAB = 1062


def probabilities(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=generator) * 3, dim=-1)
    probs[0, 5:] = 0.0  # top-k style truncation
    probs[1, :] = probs[1, 0]  # ties everywhere
    return probs


def test_draws_follow_each_rows_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.125, 0.125], [0.0, 0.0, 0.0, 0.9, 0.1]])
    draws = 20_000
    counts = torch.zeros_like(probs)
    generators = [torch.Generator().manual_seed(1), None]
    shared = torch.Generator().manual_seed(2)
    for _ in range(draws):
        picks = sampler._draw(probs, generators, shared)
        counts[0, picks[0]] += 1
        counts[1, picks[1]] += 1
    for row in range(2):
        expected = probs[row] * draws
        assert counts[row][probs[row] == 0].sum() == 0, "an entry without mass was drawn"
        kept = probs[row] > 0
        chi2 = float((((counts[row] - expected)[kept]) ** 2 / expected[kept]).sum())
        # Degrees of freedom <= 3: chi-square above 30 has probability < 1e-5 for a correct sampler.
        assert chi2 < 30, (row, counts[row].tolist(), expected.tolist())


def test_a_uniform_at_the_top_lands_on_the_last_entry_with_mass(monkeypatch):
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    monkeypatch.setattr(sampler, "_uniforms", lambda *_: torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert sampler._draw(probs, [None, None], torch.Generator()).tolist() == [1, 3]
    monkeypatch.setattr(sampler, "_uniforms", lambda *_: torch.tensor([0.0, 0.0], dtype=torch.float64))
    zero_first = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    assert sampler._draw(zero_first, [None, None], torch.Generator()).tolist() == [2, 0]


@pytest.mark.parametrize("unseeded_rows", [(), (2, 5)])
def test_a_seeded_rows_tokens_do_not_depend_on_the_batch(unseeded_rows):
    rows = 16
    together = [None if i in unseeded_rows else torch.Generator().manual_seed(1000 + i) for i in range(rows)]
    alone = {i: torch.Generator().manual_seed(1000 + i) for i in range(rows) if i not in unseeded_rows}
    shared = torch.Generator().manual_seed(7)
    for step in range(6):
        probs = probabilities(rows, step)
        batch = sampler._draw(probs, together, shared).tolist()
        for i, generator in alone.items():  # the same row drawn on its own
            drawn = sampler._draw(probs[i : i + 1], [generator], torch.Generator()).tolist()
            assert drawn == [batch[i]], step


def test_each_draw_takes_one_double_from_the_rows_generator():
    probs = probabilities(4, 0)
    generators = [torch.Generator().manual_seed(seed) for seed in (3, 5, 7, 11)]
    replay = [torch.Generator().manual_seed(seed) for seed in (3, 5, 7, 11)]
    for _ in range(3):
        picks = sampler._draw(probs, generators, torch.Generator()).tolist()
        for row, generator in enumerate(replay):
            uniform = float(torch.rand((), generator=generator, dtype=torch.float64))
            cumulative = probs[row].double().cumsum(0)
            expected = int(torch.searchsorted(cumulative, uniform * cumulative[-1], right=True))
            assert picks[row] == min(expected, VOCAB - 1)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda p: p.__setitem__((3, 7), float("nan")),
        lambda p: p.__setitem__((3, 7), float("inf")),
        lambda p: p.__setitem__((3, 7), -0.5),
        lambda p: p.__setitem__(3, 0.0),
    ],
    ids=["nan", "inf", "negative", "no-mass"],
)
def test_an_invalid_row_raises_as_multinomial_does(spoil):
    probs = probabilities(8, 0)
    spoil(probs)
    generators = [torch.Generator().manual_seed(i) for i in range(8)]
    with pytest.raises(RuntimeError) as ours:
        sampler._draw(probs, generators, torch.Generator())
    with pytest.raises(RuntimeError) as theirs:
        torch.multinomial(probs[3], 1, generator=torch.Generator())
    assert str(ours.value).split(" (")[0].split("`")[0] == str(theirs.value).split(" (")[0].split("`")[0]


def test_sample_reports_the_logprob_of_the_token_it_drew():
    """The public ``sample`` at temperature 1 (the quickstart's), seeded rows: each token's logprob is its
    ``log_softmax``, and the same seeds give the same tokens."""
    from rollflow.messages import SamplingParams

    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(16)]

    def draw() -> sampler.Sampled:
        return sampler.sample(
            logits, params, [torch.Generator().manual_seed(i) for i in range(16)], torch.Generator()
        )

    first = draw()
    assert draw().tokens == first.tokens
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(first.tokens)[:, None])[:, 0]
    assert all(
        math.isclose(a, b, abs_tol=1e-6) for a, b in zip(first.logprobs, expected.tolist(), strict=True)
    )
