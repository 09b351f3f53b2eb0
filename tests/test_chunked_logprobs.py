"""Logprobs and entropy from chunks of positions (``chunked_token_logprobs``) against the full-logits path."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig
from rollflow.train.losses import (
    chunked_token_logprobs,
    entropy_from_logits,
    model_token_logprobs,
    token_logprobs,
)

from .helpers.training import PackingTrainer, assert_same_first_step, make_batch


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _inputs(rows: int = 2, time: int = 9, hidden_size: int = 16, vocab: int = 50, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, time, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.5
    targets = torch.randint(0, vocab, (rows, time), generator=generator)
    upstream = torch.randn(rows, time, generator=generator)  # a loss with a different weight per token
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 18, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_match_the_full_logits_in_value_and_gradient(chunk_tokens, temperature):
    hidden, weight, targets, upstream = _inputs()
    full_hidden, full_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full_logits = full_hidden @ full_weight.T
    full = token_logprobs(full_logits, targets, temperature)
    (full * upstream).sum().backward()

    chunk_hidden, chunk_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    chunked = chunked_token_logprobs(
        chunk_hidden, chunk_weight, targets, temperature=temperature, chunk_tokens=chunk_tokens
    )
    (chunked.logprobs * upstream).sum().backward()

    torch.testing.assert_close(chunked.logprobs, full.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(chunk_hidden.grad, full_hidden.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk_weight.grad, full_weight.grad, rtol=0, atol=1e-5)
    expected_entropy = entropy_from_logits(full_logits.detach(), temperature)
    torch.testing.assert_close(chunked.entropy, expected_entropy, rtol=0, atol=1e-5)
    assert not chunked.entropy.requires_grad


def test_chunks_keep_no_vocabulary_sized_tensor_for_the_backward():
    """What autograd saves is the hidden states, the weight and per-row scalars: no [positions, vocab] tensor."""
    hidden, weight, targets, _ = _inputs(rows=4, time=32, vocab=500)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved: list[torch.Size] = []

    def record(tensor):
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        chunked_token_logprobs(hidden, weight, targets, chunk_tokens=16)
    largest = max(shape.numel() for shape in saved)
    assert largest == weight.numel(), saved

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        token_logprobs(hidden @ weight.T, targets)
    assert max(shape.numel() for shape in saved) == 4 * 32 * 500  # the full path keeps the logits


def test_bf16_autocast_chunks_track_the_full_logits():
    hidden, weight, targets, upstream = _inputs(vocab=300)
    results = []
    for chunk_tokens in (0, 5):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunk_tokens:
                logprobs = chunked_token_logprobs(h, w, targets, chunk_tokens=chunk_tokens).logprobs
            else:
                logprobs = token_logprobs(torch.nn.functional.linear(h, w), targets)
        (logprobs * upstream).sum().backward()
        results.append((logprobs.detach(), h.grad, w.grad))
    (full_lp, full_h, full_w), (lp, h_grad, w_grad) = results
    assert w_grad.dtype == torch.float32
    # Both matmuls run in bf16 (8 mantissa bits): equal to bf16 rounding, not bit for bit.
    torch.testing.assert_close(lp, full_lp, rtol=0, atol=0.05)
    torch.testing.assert_close(h_grad, full_h, rtol=0.05, atol=0.05)
    torch.testing.assert_close(w_grad, full_w, rtol=0.05, atol=0.05)


def test_model_logprobs_chunked_equal_full_on_the_tiny_model(base_model):
    torch.manual_seed(0)
    vocab = base_model.config.vocab_size
    input_ids = torch.randint(0, vocab, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding
    positions = torch.zeros(3, 11, dtype=torch.bool)
    positions[:, 4:] = True
    positions[1, 7:] = False
    upstream = torch.randn(3, 11)
    results = {}
    for chunk_tokens in (0, 5):
        model = copy.deepcopy(base_model)
        result = model_token_logprobs(
            model,
            input_ids,
            attention_mask,
            temperature=0.8,
            chunk_tokens=chunk_tokens,
            positions=positions,
        )
        (result.logprobs * upstream).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[chunk_tokens] = (result, grads)
    (full, full_grads), (chunked, chunked_grads) = results[0], results[5]
    torch.testing.assert_close(chunked.logprobs, full.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.entropy, full.entropy, rtol=0, atol=1e-5)
    assert (chunked.logprobs[~positions] == 0).all() and (chunked.logprobs[positions] < 0).all()
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def test_a_training_step_is_the_same_with_and_without_chunks(base_model):
    batch = make_batch(base_model, seed=3)
    trainers, metrics = [], []
    for chunk_tokens in (0, 7):
        trainer = PackingTrainer(
            copy.deepcopy(base_model),
            TrainerConfig(logprob_chunk_tokens=chunk_tokens, micro_batch_size=5),
            pad_token_id=base_model.config.pad_token_id,
        )
        result = trainer.train_step(batch, policy_version=0)
        assert result.updated
        metrics.append(result.metrics)
        trainers.append(trainer)
    for name in ("loss", "grad_norm", "entropy", "ratio_mean"):
        assert metrics[1][name] == pytest.approx(metrics[0][name], rel=1e-5, abs=1e-6), name
    assert metrics[1]["logprob_mismatch"] < 1e-5
    assert_same_first_step(trainers[1], trainers[0])
