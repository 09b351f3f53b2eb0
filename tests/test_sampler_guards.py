"""The sampler and the engine against extreme inputs: nothing a request or a weight update sends ends the engine.

The sampler is fuzzed with hypothesis over logits of every magnitude float32 holds (with masked ``-inf`` entries)
and every sampling value ``rollflow.messages.sampling_error`` accepts, at its edges included; the engine is fed
the values it must refuse, non-finite weights, and finite weights whose logits overflow.
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollflow.errors import EngineError
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.sampler import sample
from rollflow.messages import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    GenerateRequest,
    SamplingParams,
    sampling_error,
)
from rollflow.models.loading import load_causal_lm

from .helpers.waits import wait_until

VOCAB = 64
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)

temperatures = st.one_of(
    st.sampled_from([0.0, MIN_TEMPERATURE, 1e-4, 1.0, 7.5, MAX_TEMPERATURE]),
    st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE),
)
top_ps = st.one_of(st.sampled_from([MIN_TOP_P, 1e-6, 0.5, 1.0]), st.floats(MIN_TOP_P, 1.0))
top_ks = st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB, VOCAB + 1, 2**62]), st.integers(-1, 2 * VOCAB))
params = st.builds(
    SamplingParams,
    max_tokens=st.just(1),
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)


@st.composite
def logit_rows(draw) -> list[float]:
    """One row of float32 logits: any magnitude up to float32's largest, ties, and masked (-inf) entries, with
    at least one finite entry (rows without one are failed by the engine before sampling)."""
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 30.0, 1e4, 1e20, 1e38]))
    values = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=VOCAB, max_size=VOCAB))
    row = [v * scale for v in values]
    for index in draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB - 1, unique=True)):
        row[index] = -math.inf
    if draw(st.booleans()):  # a tie for the top
        row[1] = row[0] = max(r for r in row if r != -math.inf) if any(r != -math.inf for r in row) else 0.0
    if all(r == -math.inf for r in row):
        row[draw(st.integers(0, VOCAB - 1))] = 0.0
    return row


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(logit_rows(), params), min_size=1, max_size=4))
def test_sampler_draws_a_possible_token_with_a_finite_logprob_for_every_accepted_input(rows):
    logits = torch.tensor([row for row, _ in rows], dtype=torch.float32)
    row_params = [p for _, p in rows]
    assert all(sampling_error(**_fields(p)) is None for p in row_params)
    generators = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None and p.temperature > 0 else None
        for p in row_params
    ]
    tokens, logprobs, _ = sample(logits, row_params, generators, torch.Generator().manual_seed(0))
    for row, token, logprob in zip(logits, tokens, logprobs, strict=True):
        assert 0 <= token < VOCAB
        assert row[token] != -math.inf, "a masked token was drawn"
        assert math.isfinite(logprob) and logprob <= 1e-6


def _fields(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)


def test_tiny_temperature_and_top_p_keep_the_top_token_where_float32_used_to_give_nan():
    """The inputs that used to kill the engine, at the edge of what is accepted now: with the max subtracted
    first, a temperature of 1e-5 on logits of 1e38 stays finite, and top_p = 1e-8 keeps the top token."""
    logits = torch.tensor([[3e38, -3e38, 2.9e38, 0.0], [1.0, 5.0, 5.0 - 1e-6, 4.0]], dtype=torch.float32)
    extreme = SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P)
    tokens, logprobs, _ = sample(logits, [extreme, extreme], [None, None], torch.Generator().manual_seed(0))
    assert tokens[0] == 0 and tokens[1] in (1, 2)
    assert all(math.isfinite(v) for v in logprobs)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": 1e-38}, "temperature"),
        ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -1e-300}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"top_p": 1e-300}, "top_p"),
        ({"top_p": 1e-45}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_sampling_error_names_the_field(fields, field):
    values = {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None, **fields}
    problem = sampling_error(**values)
    assert problem is not None and problem[0] == field and problem[1].startswith(field)


# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.fixture
async def engine(model):
    engine = TorchEngine(
        copy.deepcopy(model), max_batch_size=4, max_model_len=128, enable_prefix_caching=False
    )
    yield engine
    await engine.shutdown()


def generate(engine: TorchEngine, params: SamplingParams = GREEDY, prompt=(5, 6, 7)):
    return engine.generate(GenerateRequest(prompt_token_ids=list(prompt), sampling=params, request_id="r"))


async def test_engine_refuses_what_the_sampler_cannot_represent_and_keeps_serving(engine):
    before = await generate(engine)
    refused = [
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=math.nan),
        SamplingParams(temperature=math.inf),
        SamplingParams(top_p=1e-300),
        SamplingParams(top_k=2**63),
        SamplingParams(seed=-1),
        SamplingParams(seed=2**64),
        SamplingParams(max_tokens=0),
    ]
    for params in refused:
        with pytest.raises(EngineError, match=r"sampling\."):
            await generate(engine, params)
    # Accepted extremes sample, batched with a greedy request that must not notice them.
    accepted = [
        SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P, seed=1),
        SamplingParams(max_tokens=8, temperature=MAX_TEMPERATURE, top_k=2**62),
        SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, top_k=1, seed=2**63 - 1),
    ]
    outputs = await asyncio.gather(generate(engine), *(generate(engine, p) for p in accepted))
    assert outputs[0].token_ids == before.token_ids
    assert all(len(o.token_ids) == 8 and all(math.isfinite(v) for v in o.logprobs) for o in outputs)
    assert not engine.is_dead and (await generate(engine)).token_ids == before.token_ids


async def test_non_finite_weights_are_refused_by_name_and_the_old_ones_keep_serving(engine, model):
    before = await generate(engine)
    state = model.state_dict()
    bad = [
        ("model.layers.0.mlp.down_proj.weight", state["model.layers.0.mlp.down_proj.weight"].clone()),
        ("model.norm.weight", state["model.norm.weight"].clone()),
    ]
    bad[0][1][0, 0] = math.nan
    bad[1][1][3] = math.inf
    with pytest.raises(
        EngineError, match=r"inf or NaN.*model\.layers\.0\.mlp\.down_proj\.weight, model\.norm\.weight"
    ):
        await engine.load_weights(bad, policy_version=7)
    output = await generate(engine)
    assert output.token_ids == before.token_ids and set(output.policy_versions) == {0}


async def test_overflowing_finite_weights_fail_each_request_alone_until_good_weights_return(engine, model):
    """Finite weights whose logits overflow (a diverged trainer) pass the load check; each request then fails
    with an error naming non-finite logits, the loop keeps running, and loading good weights restores the
    exact greedy output."""
    before = await generate(engine)
    norm = model.model.norm.weight.detach()
    await engine.load_weights([("model.norm.weight", norm * 3e38)], policy_version=1)
    results = await asyncio.gather(*(generate(engine) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, EngineError) and "non-finite logits" in str(r) for r in results), results
    assert not engine.is_dead and engine.num_failed_requests == 3
    await engine.load_weights([("model.norm.weight", norm)], policy_version=2)
    after = await generate(engine)
    assert after.token_ids == before.token_ids and set(after.policy_versions) == {2}


async def test_a_row_of_non_finite_logits_fails_its_request_alone(engine):
    """One request's logits turn NaN mid-generation (as one row of a broken kernel would) while three others
    decode in the same batch: that request fails naming the non-finite logits, the others finish exactly as
    alone."""
    expected = await generate(engine)
    real_decode = engine.runner.decode

    def decode_with_nan_in_slot_0(token_ids, positions):
        logits = real_decode(token_ids, positions)
        if positions[0] >= 0:
            logits[0, 17] = math.nan
        return logits

    engine.runner.decode = decode_with_nan_in_slot_0
    await engine.pause("abort")  # the four queue and are admitted together on resume, the first into slot 0
    results = [asyncio.ensure_future(generate(engine)) for _ in range(4)]
    await wait_until(lambda: engine.num_waiting >= 4, "the four requests queue")
    await engine.resume()
    outcomes = await asyncio.gather(*results, return_exceptions=True)
    assert isinstance(outcomes[0], EngineError) and "non-finite logits" in str(outcomes[0])
    assert [o.token_ids for o in outcomes[1:]] == [expected.token_ids] * 3
    assert engine.num_failed_requests == 1 and not engine.is_dead


def test_draws_follow_the_distribution_and_never_pick_a_cut_token():
    # The draw's frequencies are those of the distribution, and a token top-k cut (probability 0) never
    # comes up.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0, -3.0]])
    params = [SamplingParams(temperature=1.0, top_k=4)]
    draws = 40_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(draws // 500):
        batch = sample(logits.expand(500, -1), params * 500, [None] * 500, generator)
        counts += torch.bincount(torch.tensor(batch.tokens), minlength=6)
    kept = torch.tensor([True, True, True, False, True, False])  # the 4 largest logits
    expected = torch.where(kept, logits[0], torch.tensor(float("-inf"))).softmax(-1) * draws
    assert counts[~kept].sum() == 0
    # Each kept token's count within 5 standard deviations of its expectation.
    std = (expected * (1 - expected / draws)).sqrt()
    assert ((counts - expected).abs()[kept] <= 5 * std[kept] + 1).all(), (counts, expected)
    # Seeded rows draw from their own generator: the same seed gives the same tokens, whatever the batch.
    seeded = [torch.Generator().manual_seed(7) for _ in range(2)]
    alone = sample(logits, params, [seeded[0]], generator).tokens
    beside = sample(logits.expand(3, -1), params * 3, [None, seeded[1], None], generator).tokens
    assert alone == [beside[1]]
