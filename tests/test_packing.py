"""The batch packer: advantages per whole group, a token-balanced split across ranks, equal micro-batch counts,
token-budget micro-batches; and the trainer's update does not depend on how a step was packed."""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig, load_config
from rollflow.errors import ConfigError
from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch
from rollflow.models.tiny import ensure_tiny_model
from rollflow.orchestrator.packing import loss_token_count, pack_batch, sample_length
from rollflow.train.advantages import compute_advantages
from rollflow.train.trainer import Trainer, build_micro_batch

from .helpers.training import make_batch


def random_batch(seed: int, groups: int = 8, group_size: int = 4, masked_every: int = 5) -> TrainBatch:
    """Groups with lengths spread over two orders of magnitude and some masked samples."""
    rng = random.Random(seed)
    scored, count = [], 0
    for index in range(groups):
        prompt = [1] * rng.randint(0, 40)
        samples = []
        for sample_index in range(group_size):
            completion = [2] * rng.randint(1, 200)
            count += 1
            samples.append(
                Sample(
                    prompt_index=index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    logprobs=[-1.0] * len(completion),
                    policy_versions=[0] * len(completion),
                    finish_reason=FinishReason.STOP,
                    reward=rng.random(),
                    masked=count % masked_every == 0,
                )
            )
        scored.append(ScoredGroup(prompt_index=index, samples=samples))
    return TrainBatch(step=3, groups=scored)


def key(sample: Sample) -> tuple[int, int]:
    return sample.prompt_index, sample.sample_index


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_every_trainable_sample_lands_once_with_its_groups_advantage(seed, num_ranks):
    batch = random_batch(seed)
    packed = pack_batch(batch, num_ranks=num_ranks, micro_batch_size=3, micro_batch_tokens=400)
    landed = Counter(key(item.sample) for rank in packed.ranks for mb in rank.micro_batches for item in mb)
    trainable = [s for s in batch.samples if not s.masked]
    assert landed == Counter(key(s) for s in trainable)
    assert packed.metrics["num_samples"] == len(batch.samples)
    assert packed.metrics["num_masked_samples"] == len(batch.samples) - len(trainable)
    # The baseline is the whole group's, wherever its samples went.
    expected = {}
    for group in batch.groups:
        values = compute_advantages(
            [s.reward for s in group.samples], [not s.masked for s in group.samples], "grpo"
        )
        expected.update({key(s): value for s, value in zip(group.samples, values, strict=True)})
    for rank in packed.ranks:
        assert rank.step == batch.step
        for item in (item for mb in rank.micro_batches for item in mb):
            assert item.advantage == expected[key(item.sample)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_ranks_are_balanced_by_tokens_and_run_the_same_number_of_micro_batches(seed, num_ranks):
    batch = random_batch(seed, groups=12)
    packed = pack_batch(batch, num_ranks=num_ranks, micro_batch_size=4, micro_batch_tokens=500)
    counts = {len(rank.micro_batches) for rank in packed.ranks}
    assert len(counts) == 1 and packed.metrics["num_micro_batches"] == counts.pop()
    tokens = [sum(sample_length(s) for s in rank.samples) for rank in packed.ranks]
    longest = max(sample_length(s) for s in batch.samples)
    # Longest-first to the lightest rank: no rank ends more than one sample above another.
    assert max(tokens) - min(tokens) <= longest
    assert packed.metrics["rank_token_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / num_ranks))
    # A split into contiguous runs of the sorted samples (the naive split) would be far worse here.
    ordered = sorted((s for s in batch.samples if not s.masked), key=sample_length, reverse=True)
    naive = [sum(sample_length(s) for s in ordered[r::num_ranks]) for r in range(num_ranks)]
    assert max(tokens) - min(tokens) <= max(naive) - min(naive)


def test_micro_batches_keep_both_budgets_and_group_similar_lengths():
    batch = random_batch(0, groups=16)
    packed = pack_batch(batch, num_ranks=2, micro_batch_size=5, micro_batch_tokens=600)
    for rank in packed.ranks:
        for micro_batch in rank.micro_batches:
            lengths = [sample_length(item.sample) for item in micro_batch]
            assert len(lengths) <= 5
            assert len(lengths) * max(lengths, default=0) <= 600
            assert lengths == sorted(lengths, reverse=True)
    # The padded size of the step is far below every sample padded to the step's longest.
    padded = sum(
        len(mb) * max(sample_length(i.sample) for i in mb)
        for r in packed.ranks
        for mb in r.micro_batches
        if mb
    )
    trainable = [s for s in batch.samples if not s.masked]
    assert padded < 0.7 * len(trainable) * max(sample_length(s) for s in trainable)


def test_ranks_without_enough_samples_get_empty_micro_batches():
    batch = random_batch(1, groups=1, group_size=3, masked_every=100)
    packed = pack_batch(batch, num_ranks=5)
    assert [len(rank.micro_batches) for rank in packed.ranks] == [1] * 5
    assert sorted(len(rank.micro_batches[0]) for rank in packed.ranks) == [0, 0, 1, 1, 1]
    # An empty micro-batch still collates (one row of padding, no loss tokens), so its rank runs the pass.
    empty = build_micro_batch([], [], pad_token_id=7)
    assert empty.input_ids.tolist() == [[7, 7]] and not empty.loss_mask.any()
    # Nothing trainable at all: no micro-batches anywhere.
    nothing = pack_batch(random_batch(2, groups=1, group_size=1, masked_every=1), num_ranks=3)
    assert [rank.micro_batches for rank in nothing.ranks] == [[], [], []]


def test_a_sample_longer_than_the_token_budget_is_an_error_naming_the_key():
    batch = random_batch(3)
    longest = max(sample_length(s) for s in batch.samples if not s.masked)
    pack_batch(batch, micro_batch_tokens=longest)  # exactly fits
    with pytest.raises(ValueError, match=rf"trainer\.micro_batch_tokens = {longest - 1} .* {longest} tokens"):
        pack_batch(batch, micro_batch_tokens=longest - 1)
    batch.groups[0].samples[0].logprobs.append(0.0)
    with pytest.raises(ValueError, match="logprobs for"):
        pack_batch(batch)


def test_loss_token_count_matches_the_collated_mask():
    for sample in random_batch(4).samples:
        sample.loss_mask = [i % 3 != 0 for i in range(len(sample.completion_token_ids))]
        collated = build_micro_batch([sample], [1.0], pad_token_id=0)
        assert loss_token_count(sample) == int(collated.loss_mask.sum())


def test_micro_batch_tokens_must_hold_the_longest_sample_at_config_time():
    with pytest.raises(
        ConfigError, match=r"trainer\.micro_batch_tokens = 512 .*inference\.max_model_len = 1024"
    ):
        load_config(overrides=["trainer.micro_batch_tokens=512"])
    assert load_config(overrides=["trainer.micro_batch_tokens=512", "inference.max_model_len=512"])
    # A KL penalty works with several workers (each holds the reference), in the loss or the reward.
    assert load_config(overrides=["trainer.num_workers=2", "trainer.kl_coef=0.1", "trainer.kl_in='reward'"])
    with pytest.raises(ConfigError, match="trainer.parallelism"):
        load_config(overrides=["trainer.parallelism='tp'"])
    with pytest.raises(ConfigError, match="trainer.num_workers"):
        load_config(overrides=["trainer.num_workers=0"])


def test_the_update_does_not_depend_on_the_token_budget():
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    batch = make_batch(base, groups=4, group_size=4)
    longest = max(sample_length(s) for s in batch.samples)
    results = []
    for budget in (None, longest, 2 * longest):
        model = copy.deepcopy(base)
        config = TrainerConfig(micro_batch_tokens=budget, max_grad_norm=1e6)
        trainer = Trainer(model, config, pad_token_id=model.config.pad_token_id)
        packed = pack_batch(batch, micro_batch_tokens=budget)
        metrics = trainer.train_step(packed).metrics
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((packed.metrics["num_micro_batches"], metrics, grads))
    counts = [count for count, _, _ in results]
    assert counts[0] == 1 and counts[1] > counts[2] > 1  # the budget did split the step
    (_, reference, reference_grads), *others = results
    assert reference["num_loss_tokens"] == sum(loss_token_count(s) for s in batch.samples)
    for _, metrics, grads in others:
        for name in ("loss", "grad_norm", "entropy", "num_loss_tokens", "ratio_mean"):
            assert metrics[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), name
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6)


def test_the_trainer_takes_only_batches_packed_for_its_ranks():
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    trainer = Trainer(model, TrainerConfig(), pad_token_id=0)
    batch = make_batch(model)
    with pytest.raises(TypeError, match="PackedBatch.*pack_for_trainer"):
        trainer.train_step(batch)
    with pytest.raises(ValueError, match="packed for 2 ranks, but this trainer has 1"):
        trainer.train_step(pack_batch(batch, num_ranks=2))
