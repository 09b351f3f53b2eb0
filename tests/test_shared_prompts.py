"""Shared prompts: a group's prompt runs once in the trainer's forward, and nothing it computes changes."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig
from rollflow.config.loading import build_config
from rollflow.errors import ConfigError
from rollflow.train.losses import model_token_logprobs
from rollflow.train.micro_batch import build_micro_batch
from rollflow.train.shared_prompts import pack_shared_prompts, supports_shared_prompts
from tests.helpers.training import (
    assert_same_first_step,
    make_batch,
    make_sample,
    make_trainer,
    redraw_matrices,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The tiny model with re-drawn weights, so that a wrong mask or position changes the logprobs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return redraw_matrices(model)


def grouped_samples(seed: int = 0):
    """Three groups of varied prompt and completion lengths, a lone sample and one with an empty prompt."""
    rng = random.Random(seed)
    samples = []
    for index, (prompt_len, group_size) in enumerate([(9, 4), (3, 5), (14, 3), (6, 1), (0, 1)]):
        prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
        for sample_index in range(group_size):
            completion = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 9))]
            samples.append(
                make_sample(
                    prompt, completion, [0.0] * len(completion), index=index, sample_index=sample_index
                )
            )
    rng.shuffle(samples)  # members of a group need not be neighbours
    return samples


def logprobs_and_grads(model, batch, *, shared: bool, chunk_tokens: int = 1024):
    model.zero_grad(set_to_none=True)
    result = model_token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        positions=batch.loss_mask,
        chunk_tokens=chunk_tokens,
        temperature=0.7,
        shared_prompts=batch.shared_prompts if shared else None,
    )
    (
        result.logprobs * torch.linspace(-1.0, 1.0, result.logprobs.numel()).view_as(result.logprobs)
    ).sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return result, grads


@pytest.mark.parametrize("chunk_tokens", [1024, 0], ids=["chunked", "full-logits"])
def test_packed_forward_gives_each_rows_logprobs_entropy_and_gradients(model, chunk_tokens):
    batch = build_micro_batch(grouped_samples(), [1.0] * 14, pad_token_id=0, share_prompts=True)
    layout = batch.shared_prompts
    assert layout is not None
    # 3 shared prompts, the lone sample and the empty prompt's: 5 packed rows for 14 samples.
    assert layout.input_ids.shape[0] == 5
    assert layout.input_ids.numel() < 0.8 * batch.input_ids.numel()
    rows, row_grads = logprobs_and_grads(model, batch, shared=False, chunk_tokens=chunk_tokens)
    packed, packed_grads = logprobs_and_grads(model, batch, shared=True, chunk_tokens=chunk_tokens)
    assert torch.allclose(packed.logprobs, rows.logprobs, atol=1e-5)
    assert torch.allclose(packed.entropy, rows.entropy, atol=1e-5)
    assert (packed.logprobs[~batch.loss_mask] == 0).all()
    for name, grad in row_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_a_wrong_layout_would_show(model):
    """The comparison above can fail: completions that saw each other (no block mask) give other logprobs."""
    batch = build_micro_batch(grouped_samples(), [1.0] * 14, pad_token_id=0, share_prompts=True)
    layout = batch.shared_prompts
    causal_only = torch.ones_like(layout.attention_mask).tril()
    leaky = type(layout)(layout.input_ids, layout.position_ids, causal_only, layout.gather)
    with torch.no_grad():
        rows = model_token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.loss_mask)
        wrong = model_token_logprobs(
            model, batch.input_ids, batch.attention_mask, positions=batch.loss_mask, shared_prompts=leaky
        )
    assert (wrong.logprobs - rows.logprobs).abs().max() > 1e-2


def test_a_long_group_takes_several_rows_and_little_saving_takes_none():
    prompt = list(range(3, 203))
    completions = [list(range(300, 400)) for _ in range(6)]
    layout = pack_shared_prompts([prompt] * 6, completions, time_len=300, pad_token_id=0)
    # A packed row holds at most max(2 * 300, 512) positions: the prompt and 4 completions, then 2 more.
    assert layout is not None and layout.input_ids.shape == (2, 600)
    assert layout.gather[4, :200].tolist() == list(range(600, 800))  # the fifth sample reads row 1's prompt
    assert layout.gather[5, 200:202].tolist() == [900, 901]
    # Distinct prompts save nothing; two samples of a short prompt save less than a fifth.
    assert pack_shared_prompts([[1, 2], [3, 4]], [[5], [6]], time_len=3, pad_token_id=0) is None
    assert pack_shared_prompts([[1], [1]], [[5, 6, 7], [8, 9, 10]], time_len=4, pad_token_id=0) is None


def test_groups_that_ask_the_same_prompt_keep_rows_of_their_own():
    prompt, completions = list(range(3, 20)), [[5, 6, 7, 8]] * 8
    merged = pack_shared_prompts([prompt] * 8, completions, time_len=21, pad_token_id=0)
    apart = pack_shared_prompts(
        [prompt] * 8, completions, time_len=21, pad_token_id=0, groups=[0] * 4 + [1] * 4
    )
    assert merged.input_ids.shape == (1, 17 + 8 * 4)
    assert apart.input_ids.shape == (2, 17 + 4 * 4)
    assert apart.gather[4, :17].tolist() == list(range(33, 50))  # the second group reads its own prompt
    samples = [
        make_sample(prompt, [5, 6, 7, 8], [0.0] * 4, index=row // 4, sample_index=row % 4) for row in range(8)
    ]
    batch = build_micro_batch(samples, [1.0] * 8, pad_token_id=0, share_prompts=True)
    assert batch.shared_prompts.input_ids.shape == (2, 33)


def test_padding_positions_never_see_a_fully_masked_row():
    layout = pack_shared_prompts([[1, 2, 3]] * 3, [[4], [5, 6, 7, 8], [9]], time_len=7, pad_token_id=0)
    assert layout is not None
    assert layout.attention_mask.any(dim=-1).all()
    assert layout.position_ids[0, :9].tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 3]


def test_only_models_that_take_the_mask_as_given_share(model):
    assert supports_shared_prompts(model)
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert not supports_shared_prompts(eager)
    windowed = copy.deepcopy(model)
    windowed.config.layer_types = ["sliding_attention", "full_attention"]
    assert not supports_shared_prompts(windowed)
    assert not supports_shared_prompts(torch.nn.Linear(2, 2))


def test_a_step_with_shared_prompts_updates_the_weights_as_one_without(model):
    batch = make_batch(model, seed=3, groups=3, group_size=4)
    trained = {}
    for share in (True, False):
        trainer = make_trainer(copy.deepcopy(model), share_prompts=share)
        assert trainer.share_prompts is share
        trained[share] = (trainer, trainer.train_step(batch))
    (shared_trainer, shared), (row_trainer, rows) = trained[True], trained[False]
    assert shared.metrics["loss"] == pytest.approx(rows.metrics["loss"], abs=1e-6)
    assert shared.metrics["grad_norm"] == pytest.approx(rows.metrics["grad_norm"], rel=1e-4)
    assert_same_first_step(shared_trainer, row_trainer)


def test_share_prompts_is_a_bool():
    with pytest.raises(ConfigError, match=r"trainer\.share_prompts"):
        build_config({"trainer": {"share_prompts": "yes"}})
    assert TrainerConfig().share_prompts is True
