"""Sampling masks: the sampler records each token's top-k/top-p kept set as one count, and the trainer
renormalises its logprobs, entropy and gradient over the same set (``trainer.sampling_mask = "replay"``)."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig, load_config
from rollflow.errors import ConfigError
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.sampler import sample
from rollflow.messages import FinishReason, GenerateRequest, Sample, SamplingParams
from rollflow.models.tiny import ensure_tiny_model
from rollflow.train.aggregation import UpdateCounts
from rollflow.train.losses import kept_set_mask, model_token_logprobs
from rollflow.train.trainer import Trainer, build_micro_batch

from .helpers.training import redraw_matrices

# Ties at 1.0 (ids 1, 2 and 7): the sampler's rule keeps the lower ids first.
ROW = [2.0, 1.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.0]


def hand_kept_set(row: list[float], temperature: float, top_k: int, top_p: float) -> list[int]:
    """Top-k then top-p on the renormalised top-k, in plain Python: ids by descending logit, ties by id."""
    ranked = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if top_k > 0:
        ranked = ranked[:top_k]
    weights = [math.exp(row[i] / temperature) for i in ranked]
    total = sum(weights)
    kept, mass = [], 0.0
    for token, weight in zip(ranked, weights, strict=True):
        if mass >= top_p:
            break
        kept.append(token)
        mass += weight / total
    return kept


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 3, 1.0), (0.7, 4, 1.0), (1.0, -1, 0.8), (0.5, -1, 0.9), (1.3, 5, 0.7), (1.0, 2, 0.3)],
)
def test_sampler_records_the_kept_set_of_a_hand_computation(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    kept = hand_kept_set(ROW, temperature, top_k, top_p)
    logits = torch.tensor([ROW] * 64)
    seen = set()
    for seed in range(8):
        tokens, logprobs, counts = sample(
            logits, [params] * 64, [None] * 64, torch.Generator().manual_seed(seed)
        )
        assert counts == [len(kept)] * 64
        normaliser = math.log(sum(math.exp(ROW[i] / temperature) for i in kept))
        for token, logprob in zip(tokens, logprobs, strict=True):
            assert token in kept
            assert logprob == pytest.approx(ROW[token] / temperature - normaliser, abs=1e-6)
        seen.update(tokens)
    assert seen == set(kept)  # every kept token is drawn, and only those
    # The trainer's rebuild of the set from the count is the same set, ties included.
    mask = kept_set_mask(logits[:1] / temperature, torch.tensor([kept[0]]), torch.tensor([len(kept)]))
    assert sorted(mask[0].nonzero()[:, 0].tolist()) == sorted(kept)


def test_rows_without_truncation_record_zero_and_keep_the_full_softmax():
    logits = torch.tensor([ROW, ROW])
    rows = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.7)]
    tokens, logprobs, counts = sample(logits, rows, [None, None], torch.Generator().manual_seed(0))
    assert counts[0] == 3 and counts[1] == 0
    full = torch.log_softmax(torch.tensor(ROW) / 0.7, dim=-1)
    assert logprobs[1] == pytest.approx(float(full[tokens[1]]), abs=1e-6)
    # A top-k as large as the vocabulary cuts nothing.
    _, _, counts = sample(logits[:1], [SamplingParams(top_k=len(ROW))], [None], torch.Generator())
    assert counts == [0]


def test_kept_set_mask_ties_keep_the_lower_ids_and_the_target():
    scaled = torch.tensor([ROW])
    mask = kept_set_mask(scaled, torch.tensor([5]), torch.tensor([3]))  # target 5 is far outside the top 3
    assert mask[0].nonzero()[:, 0].tolist() == [0, 1, 4, 5]
    assert kept_set_mask(scaled, torch.tensor([0]), torch.tensor([0])) is None
    assert kept_set_mask(scaled, torch.tensor([0]), torch.tensor([len(ROW)])) is None


# ---------------------------------------------------------------- engine and trainer agree


@pytest.fixture(scope="module")
def varied_model():
    """The tiny model with re-drawn weights, so that its distributions are far from uniform."""
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()
    return redraw_matrices(model)


TEMPERATURE = 0.7


async def engine_samples(
    model, params: SamplingParams, logprobs_mode: str = "processed_logprobs"
) -> list[Sample]:
    engine = TorchEngine(
        copy.deepcopy(model), max_batch_size=4, max_model_len=128, logprobs_mode=logprobs_mode
    )
    prompts = [[5, 17, 300, 42], [7, 8, 9], [1000, 3, 77, 12, 99]]
    try:
        outputs = await asyncio.gather(
            *(
                engine.generate(GenerateRequest(prompt_token_ids=p, sampling=params, request_id=str(i)))
                for i, p in enumerate(prompts)
            )
        )
    finally:
        await engine.shutdown()
    return [
        Sample(
            prompt_index=0,
            sample_index=i,
            prompt_token_ids=prompt,
            completion_token_ids=output.token_ids,
            logprobs=output.logprobs,
            policy_versions=output.policy_versions,
            finish_reason=FinishReason.LENGTH,
            kept_counts=output.kept_counts,
        )
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
    ]


def trainer_for(model, **config) -> Trainer:
    return Trainer(copy.deepcopy(model), TrainerConfig(device="cpu", **config), temperature=TEMPERATURE)


TRUNCATIONS = {
    "top_k": SamplingParams(max_tokens=12, temperature=TEMPERATURE, top_k=20, seed=3),
    "top_p": SamplingParams(max_tokens=12, temperature=TEMPERATURE, top_p=0.8, seed=4),
    "both": SamplingParams(max_tokens=12, temperature=TEMPERATURE, top_k=30, top_p=0.9, seed=5),
}


@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.parametrize("truncation", sorted(TRUNCATIONS))
async def test_trainer_renormalised_logprobs_equal_the_engines(varied_model, truncation, chunk_tokens):
    samples = await engine_samples(varied_model, TRUNCATIONS[truncation])
    counts = [c for s in samples for c in s.kept_counts]
    assert all(0 < c < varied_model.config.vocab_size for c in counts)
    trainer = trainer_for(varied_model, logprob_chunk_tokens=chunk_tokens)
    batch = build_micro_batch(samples, [1.0] * len(samples), pad_token_id=0)
    with torch.no_grad():
        policy = trainer._token_logprobs(trainer.model, batch)
    mask = batch.loss_mask
    diff = (policy.logprobs - batch.old_logprobs)[mask].abs()
    assert float(diff.max()) < 1e-5
    # The entropy is the sampler's: of the renormalised kept set, so at most log(kept count).
    assert bool((policy.entropy[mask] <= batch.kept_counts[mask].float().log() + 1e-5).all())
    # Ignoring the masks trains the full softmax; the anchor moves onto it by the kept set's log mass.
    ignoring = trainer_for(varied_model, logprob_chunk_tokens=chunk_tokens, sampling_mask="ignore")
    with torch.no_grad():
        full = ignoring._token_logprobs(ignoring.model, batch)
    shifted = ignoring._behaviour_on_trained_support(batch, full)
    assert float((full.logprobs - shifted.old_logprobs)[mask].abs().max()) < 1e-5
    assert bool((full.logprobs[mask] < policy.logprobs[mask]).all())  # the tail holds mass


async def test_reference_logprobs_and_kl_are_over_the_kept_sets_too(varied_model):
    """The KL term's reference logprobs are renormalised like the policy's: with the reference equal to the
    policy they equal the engine's, and a training step reports a zero KL and the sampler's entropy."""
    samples = await engine_samples(varied_model, TRUNCATIONS["both"])
    trainer = trainer_for(varied_model, kl_coef=0.1)
    batch = build_micro_batch(samples, [1.0, -1.0, 0.5], pad_token_id=0)
    with torch.no_grad():
        reference = trainer._token_logprobs(trainer.reference_model, batch)
    assert float((reference.logprobs - batch.old_logprobs)[batch.loss_mask].abs().max()) < 1e-5
    tokens = float(batch.loss_mask.sum())
    counts = UpdateCounts(loss_tokens=tokens, sequences=float(batch.loss_mask.any(dim=1).sum()))
    metrics, _ = trainer._forward_backward(batch, counts, tokens, reference=reference.logprobs)
    assert abs(float(metrics["kl"])) < 1e-6
    assert float(metrics["logprob_mismatch_sum"]) / float(metrics["logprob_mismatch_tokens"]) < 1e-5
    mask = batch.loss_mask
    assert float(metrics["entropy"]) <= float(batch.kept_counts[mask].float().log().mean()) + 1e-5


async def test_renormalised_gradient_of_the_chunked_path_equals_autograd_on_full_logits(varied_model):
    samples = await engine_samples(varied_model, TRUNCATIONS["both"])
    batch = build_micro_batch(samples, [1.0] * len(samples), pad_token_id=0)
    grads = []
    for chunk_tokens in (0, 7):
        model = copy.deepcopy(varied_model)
        result = model_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            temperature=TEMPERATURE,
            chunk_tokens=chunk_tokens,
            positions=batch.loss_mask,
            kept_counts=batch.kept_counts,
        )
        result.logprobs[batch.loss_mask].sum().backward()
        grads.append(model.get_output_embeddings().weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert float(grads[0].abs().max()) > 0


async def test_raw_logprobs_mode_reports_vllms_untempered_logprobs(varied_model):
    """The engine's emulation of a vLLM started without ``--logprobs-mode processed_logprobs``."""
    samples = await engine_samples(varied_model, TRUNCATIONS["top_k"], logprobs_mode="raw_logprobs")
    batch = build_micro_batch(samples, [1.0] * len(samples), pad_token_id=0)
    with torch.no_grad():
        logits = varied_model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    raw = torch.log_softmax(logits, dim=-1).gather(-1, batch.target_ids[..., None])[..., 0]
    assert float((raw - batch.old_logprobs)[batch.loss_mask].abs().max()) < 1e-5


def test_kept_counts_must_match_the_completion():
    sample = Sample(
        prompt_index=3,
        sample_index=1,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        logprobs=[-1.0, -1.0],
        policy_versions=[0, 0],
        finish_reason=FinishReason.LENGTH,
        kept_counts=[5],
    )
    with pytest.raises(ValueError, match="1 kept counts for 2 completion tokens"):
        build_micro_batch([sample], [1.0], pad_token_id=0)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.sampling_mask='auto'", "trainer.sampling_mask"),
        ("trainer.sampling_mask='Replay'", "trainer.sampling_mask"),
        ("trainer.sampling_mask=1", "trainer.sampling_mask"),
        ("trainer.sampling_mask=true", "trainer.sampling_mask"),
        ("inference.check_logprobs='yes'", "inference.check_logprobs"),
        ("inference.check_logprobs=0", "inference.check_logprobs"),
    ],
)
def test_bad_sampling_mask_and_check_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"invalid value for '{key}'"):
        load_config([], [override])


def test_sampling_mask_defaults_to_replay_and_takes_ignore():
    assert load_config([], []).trainer.sampling_mask == "replay"
    assert load_config([], ["trainer.sampling_mask='ignore'"]).trainer.sampling_mask == "ignore"
    assert load_config([], ["inference.check_logprobs=false"]).inference.check_logprobs is False
