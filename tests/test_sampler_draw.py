"""Seeded rows are drawn for the whole batch at once, yet each row's token is exactly what
``torch.multinomial(row, 1, generator=its own)`` draws, step after step (the generators advance alike), and an
invalid row raises as ``torch.multinomial`` does (the sampler then retries on guarded logits)."""

from __future__ import annotations

import pytest
import torch

from rollflow.inference.engine import sampler

VOCAB = 1062  # the tiny model's


def probabilities(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=generator) * 3, dim=-1)
    probs[0, 5:] = 0.0  # top-k style truncation
    probs[1, :] = probs[1, 0]  # ties everywhere
    return probs


def per_row_multinomial(probs, generators, shared):
    picks = []
    unseeded = [i for i, g in enumerate(generators) if g is None]
    drawn = {}
    if unseeded:
        shared_picks = torch.multinomial(probs[unseeded], 1, generator=shared)[:, 0].tolist()
        drawn = dict(zip(unseeded, shared_picks, strict=True))
    for i, generator in enumerate(generators):
        if generator is None:
            picks.append(drawn[i])
        else:
            picks.append(int(torch.multinomial(probs[i], 1, generator=generator)))
    return picks


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("unseeded_rows", [(), (2, 5)])
def test_each_seeded_row_draws_what_multinomial_draws(monkeypatch, fast, unseeded_rows):
    monkeypatch.setitem(sampler._RACE_MATCHES, ("cpu", torch.float32), fast)
    rows = 64
    ours = [None if i in unseeded_rows else torch.Generator().manual_seed(1000 + i) for i in range(rows)]
    theirs = [None if i in unseeded_rows else torch.Generator().manual_seed(1000 + i) for i in range(rows)]
    shared_ours, shared_theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for step in range(6):
        probs = probabilities(rows, step)
        expected = per_row_multinomial(probs, theirs, shared_theirs)
        assert sampler._draw(probs, ours, shared_ours).tolist() == expected, step


def test_the_batched_draw_is_proven_equal_on_this_build():
    # Where a torch release changes multinomial, this fails and the engine falls back to it row by row.
    assert sampler._race_matches_multinomial(torch.device("cpu"), torch.float32)


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


def test_seeded_sampling_is_unchanged_through_sample():
    """The public ``sample`` at temperature 1 (the quickstart's), seeded rows, equals a per-row reference."""
    from rollflow.messages import SamplingParams

    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(16)]
    ours = [torch.Generator().manual_seed(i) for i in range(16)]
    theirs = [torch.Generator().manual_seed(i) for i in range(16)]
    sampled = sampler.sample(logits, params, ours, torch.Generator())
    probs = torch.log_softmax(logits, dim=-1).exp()
    assert sampled.tokens == [
        int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, theirs, strict=True)
    ]
