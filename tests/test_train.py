"""Advantages, the PPO-clip loss and the torch trainer, on the real tiny model."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from rollflow.errors import CheckpointError
from rollflow.messages import ScoredGroup, TrainBatch
from rollflow.models.tiny import ensure_tiny_model
from rollflow.train.advantages import compute_advantages
from rollflow.train.losses import entropy_from_logits, ppo_clip_loss
from rollflow.train.trainer import build_micro_batch

from .helpers.training import behaviour_logprobs, make_batch, make_sample, make_trainer

METHODS = ["grpo", "grpo_no_std", "rloo"]


# ---------------------------------------------------------------- helpers and fixtures


@pytest.fixture(scope="module")
def base_model():
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model())


@pytest.fixture
def model(base_model):
    return copy.deepcopy(base_model)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def assert_same_optimizer_state(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert torch.equal(actual["state"][index][key], value), (index, key)


# ---------------------------------------------------------------- advantages


def test_grpo_normalises_by_population_std():
    advantages = compute_advantages([1.0, 0.0, 0.0, 1.0], [True] * 4, "grpo")
    # mean 0.5, population std 0.5
    assert advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_grpo_no_std_subtracts_the_mean():
    assert compute_advantages([3.0, 1.0, 2.0], [True] * 3, "grpo_no_std") == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    rewards = [1.0, 2.0, 3.0, 6.0]
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]
    assert compute_advantages(rewards, [True] * 4, "rloo") == pytest.approx(expected)
    assert expected[0] == pytest.approx(1.0 - 11.0 / 3.0)


@pytest.mark.parametrize("method", METHODS)
def test_masked_samples_get_zero_and_leave_the_baseline_alone(method):
    masked = compute_advantages(
        [1.0, float("nan"), 0.0, 1000.0, 0.5], [True, False, True, False, True], method
    )
    unmasked = compute_advantages([1.0, 0.0, 0.5], [True] * 3, method)
    assert masked[1] == 0.0 and masked[3] == 0.0
    assert [masked[0], masked[2], masked[4]] == pytest.approx(unmasked)
    assert any(a != 0 for a in unmasked)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("rewards", "valid"),
    [
        ([0.1] * 5, [True] * 5),  # 0.1 is not exact in binary: the mean differs from 0.1 by rounding
        ([0.7, 0.2], [True, False]),  # one valid sample
        ([1.0, 0.0], [False, False]),  # nothing valid
        ([], []),
    ],
)
def test_constant_groups_give_exact_zeros(method, rewards, valid):
    assert compute_advantages(rewards, valid, method) == [0.0] * len(rewards)


@pytest.mark.parametrize("method", METHODS)
def test_non_finite_rewards_propagate(method):
    advantages = compute_advantages([math.inf, 0.0, 1.0], [True] * 3, method)
    assert not all(math.isfinite(a) for a in advantages)


@pytest.mark.parametrize("method", METHODS)
def test_a_trajectory_counts_once_in_the_baseline_however_many_samples_it_composed(method):
    """Trajectory 0 (reward 1) branched into 3 samples, trajectories 1 and 2 (reward 0) into 1 each: the
    baseline is over the 3 trajectories, as if each had one sample, and a trajectory's samples share its
    advantage. Without trajectories the branches would tilt the mean towards trajectory 0."""
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0]
    per_trajectory = compute_advantages([1.0, 0.0, 0.0], [True] * 3, method)
    advantages = compute_advantages(rewards, [True] * 5, method, trajectories=[0, 0, 0, 1, 2])
    assert advantages == pytest.approx([per_trajectory[0]] * 3 + per_trajectory[1:])
    assert advantages != pytest.approx(compute_advantages(rewards, [True] * 5, method))


def test_trajectories_mix_with_masked_and_standalone_samples():
    # A masked sample of trajectory 0 leaves its trajectory's reward alone; None samples stand alone.
    advantages = compute_advantages(
        [1.0, 99.0, 0.0, 0.5], [True, False, True, True], "grpo_no_std", trajectories=[0, 0, None, None]
    )
    assert advantages == pytest.approx([0.5, 0.0, -0.5, 0.0])


def test_advantage_inputs_are_checked():
    with pytest.raises(ValueError, match="one entry per sample"):
        compute_advantages([1.0, 2.0], [True], "grpo")
    with pytest.raises(ValueError, match="trajectories must have one entry per sample"):
        compute_advantages([1.0, 2.0], [True, True], "grpo", trajectories=[0])
    with pytest.raises(ValueError, match="unknown advantage method"):
        compute_advantages([1.0, 2.0], [True, True], "ppo")


# ---------------------------------------------------------------- loss and collation


def test_loss_mask_covers_exactly_the_completion_tokens():
    pad = 7
    samples = [
        make_sample([11, 12, 13], [21, 22], [-1.0, -2.0]),
        make_sample([11], [21, 22, 23, 24, 25], [-1.0, -2.0, -3.0, -4.0, -5.0]),
        make_sample([11, 12, 13, 14, 15, 16], [21], [-1.5]),
        make_sample([], [21, 22, 23], [-1.0, -2.0, -3.0]),  # empty prompt: first token has no predictor
    ]
    batch = build_micro_batch(samples, [0.5, -1.0, 2.0, 3.0], pad_token_id=pad)
    assert batch.input_ids.shape == (4, 7) and batch.loss_mask.shape == (4, 6)
    for row, sample in enumerate(samples):
        prompt_len, length = (
            len(sample.prompt_token_ids),
            len(sample.prompt_token_ids + sample.completion_token_ids),
        )
        first = max(prompt_len - 1, 0)
        assert batch.loss_mask[row].nonzero().flatten().tolist() == list(range(first, length - 1))
        skipped = first - (prompt_len - 1)
        mask = batch.loss_mask[row]
        assert batch.target_ids[row][mask].tolist() == sample.completion_token_ids[skipped:]
        assert batch.old_logprobs[row][mask].tolist() == sample.logprobs[skipped:]
        assert (batch.advantages[row][mask] == [0.5, -1.0, 2.0, 3.0][row]).all()
        assert (batch.advantages[row][~mask] == 0).all() and (batch.old_logprobs[row][~mask] == 0).all()
        assert batch.attention_mask[row].tolist() == [1] * length + [0] * (7 - length)
        assert (batch.input_ids[row, length:] == pad).all()


def test_explicit_loss_mask_trains_only_sampled_turns():
    """Multi-turn samples: tool tokens between two sampled turns are in the input but not in the loss."""
    sample = make_sample([11, 12], [21, 22, 31, 32, 23], [-1.0, -2.0, 0.0, 0.0, -3.0])
    sample.loss_mask = [True, True, False, False, True]
    batch = build_micro_batch([sample], [1.0], pad_token_id=0)
    assert batch.target_ids[0][batch.loss_mask[0]].tolist() == [21, 22, 23]
    assert batch.old_logprobs[0][batch.loss_mask[0]].tolist() == [-1.0, -2.0, -3.0]
    sample.loss_mask = [True]
    with pytest.raises(ValueError, match="loss_mask of 1 entries for 5"):
        build_micro_batch([sample], [1.0], pad_token_id=0)


def test_loss_mismatched_logprobs_are_rejected():
    with pytest.raises(ValueError, match="2 logprobs for 3 completion tokens"):
        build_micro_batch([make_sample([1], [2, 3, 4], [-1.0, -1.0])], [1.0], pad_token_id=0)


def test_loss_ignores_everything_off_the_mask():
    generator = torch.Generator().manual_seed(0)
    shape = (3, 8)
    new = torch.randn(shape, generator=generator).requires_grad_()
    old = new.detach() + 0.1 * torch.randn(shape, generator=generator)
    ref = new.detach() + 0.1 * torch.randn(shape, generator=generator)
    advantages = torch.randn(shape, generator=generator)
    mask = torch.rand(shape, generator=generator) > 0.4

    def loss_and_grad(old, advantages, ref):
        new.grad = None
        result = ppo_clip_loss(
            new, old, advantages, mask, clip_low=0.2, clip_high=0.2, ref_logprobs=ref, kl_coef=0.1
        )
        result.loss.backward()
        return result, new.grad.clone()

    clean, clean_grad = loss_and_grad(old, advantages, ref)
    garbage = torch.where(mask, 0.0, float("nan"))
    dirty, dirty_grad = loss_and_grad(old + garbage, advantages + garbage, ref + garbage)
    assert torch.equal(clean.loss, dirty.loss) and torch.equal(clean_grad, dirty_grad)
    assert (clean_grad[~mask] == 0).all() and (clean_grad[mask] != 0).all()
    assert clean.kl is not None and clean.kl > 0


def test_loss_clips_the_ratio_asymmetrically():
    ratio = torch.tensor([1.5, 1.25, 0.5, 0.5, 0.9])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    new = ratio.log().requires_grad_()
    result = ppo_clip_loss(
        new, torch.zeros(5), advantages, torch.ones(5, dtype=torch.bool), clip_low=0.2, clip_high=0.3
    )
    # per token: clip to 1.3 (clipped); 1.25 inside; 0.5 with A>0 is not clipped (pessimistic min);
    # 0.5 with A<0 clips to 0.8 (clipped); 0.9 inside.
    expected = [-1.3, -1.25, -0.5, 0.8, 0.9]
    assert result.loss.item() == pytest.approx(sum(expected) / 5)
    assert result.clip_fraction.item() == pytest.approx(2 / 5)
    assert result.ratio_mean.item() == pytest.approx(ratio.mean().item())
    assert result.kl is None
    result.loss.backward()
    assert new.grad[0] == 0 and new.grad[3] == 0 and new.grad[1] != 0  # no gradient through clipped tokens


def test_entropy_from_logits_matches_categorical():
    logits = torch.randn(5, 7, 33, generator=torch.Generator().manual_seed(1))
    expected = torch.distributions.Categorical(logits=logits / 0.7).entropy()
    torch.testing.assert_close(entropy_from_logits(logits, temperature=0.7, chunk_rows=4), expected)


# ---------------------------------------------------------------- trainer


def test_logprob_mismatch_is_zero_for_the_samplers_own_logprobs(model):
    temperature = 0.7
    batch = make_batch(model, temperature=temperature)
    # Entropy per loss token from the same independent, unpadded forward passes.
    entropies = []
    with torch.no_grad():
        for sample in batch.samples:
            ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
            logits = model(input_ids=ids).logits[0, len(sample.prompt_token_ids) - 1 : -1]
            entropies += torch.distributions.Categorical(logits=logits / temperature).entropy().tolist()
    trainer = make_trainer(model, temperature=temperature, micro_batch_size=5)

    metrics = trainer.train_step(batch).metrics

    assert metrics["logprob_mismatch"] < 1e-4 and metrics["logprob_mismatch_max"] < 1e-4
    assert metrics["num_loss_tokens"] == sum(len(s.completion_token_ids) for s in batch.samples)
    assert metrics["entropy"] == pytest.approx(sum(entropies) / len(entropies), abs=1e-4)
    # On-policy and before the update: every ratio is 1, nothing is clipped.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_fraction"] == 0.0


def test_logprob_mismatch_counts_only_tokens_of_the_trained_version(model):
    """Stale tokens differ from the trainer by design; the numerical check uses on-policy tokens only."""
    batch = make_batch(model)
    samples = batch.samples
    for sample in samples[: len(samples) // 2]:
        sample.logprobs = [value - 0.5 for value in sample.logprobs]  # "sampled by an older policy"
        sample.policy_versions = [3] * len(sample.completion_token_ids)
    for sample in samples[len(samples) // 2 :]:
        sample.policy_versions = [4] * len(sample.completion_token_ids)
    metrics = make_trainer(model).train_step(batch, policy_version=4).metrics
    on_policy_tokens = sum(len(s.completion_token_ids) for s in samples[len(samples) // 2 :])
    assert metrics["logprob_mismatch_tokens"] == on_policy_tokens
    assert metrics["logprob_mismatch"] < 1e-4
    stale_only = make_trainer(model).train_step(batch, policy_version=5).metrics
    assert stale_only["logprob_mismatch_tokens"] == 0 and math.isnan(stale_only["logprob_mismatch"])


def test_logprob_mismatch_leaves_out_samples_that_span_versions(model):
    """A sample that crossed a ``keep`` barrier has tokens of the trained version computed over an older
    version's keys and values: no forward of the trained weights reproduces them, so the whole sample is
    left out of the numerical check."""
    batch = make_batch(model)
    samples = batch.samples
    spanning = samples[0]
    half = len(spanning.completion_token_ids) // 2
    spanning.policy_versions = [3] * half + [4] * (len(spanning.completion_token_ids) - half)
    spanning.logprobs = [value - 0.5 for value in spanning.logprobs]  # off for the trained weights
    for sample in samples[1:]:
        sample.policy_versions = [4] * len(sample.completion_token_ids)
    metrics = make_trainer(model).train_step(batch, policy_version=4).metrics
    assert metrics["logprob_mismatch_tokens"] == sum(len(s.completion_token_ids) for s in samples[1:])
    assert metrics["logprob_mismatch"] < 1e-4


def test_micro_batching_gives_the_same_update(base_model):
    batch = make_batch(base_model, groups=3, group_size=4)
    results = []
    for micro_batch_size in (64, 5, 1):
        model = copy.deepcopy(base_model)
        trainer = make_trainer(model, micro_batch_size=micro_batch_size, max_grad_norm=1e6)
        metrics = trainer.train_step(batch).metrics
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((metrics, grads, weights(model)))

    (metrics, grads, after), others = results[0], results[1:]
    for other_metrics, other_grads, other_after in others:
        for key in ("loss", "grad_norm", "entropy", "logprob_mismatch", "num_loss_tokens"):
            assert other_metrics[key] == pytest.approx(metrics[key], abs=1e-5), key
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, atol=1e-5, rtol=1e-4)
        # Adam's first step is about lr * g / |g|, which turns float rounding in near-zero gradient entries
        # into differences of up to ~lr; the gradients above are the tight check.
        for name, tensor in after.items():
            torch.testing.assert_close(other_after[name], tensor, atol=1e-4, rtol=0)
    assert any(not torch.equal(after[name], base_model.state_dict()[name]) for name in after)


def test_positive_advantage_tokens_become_more_likely(model):
    rng = random.Random(3)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(6)]
    good = [rng.randrange(model.config.vocab_size) for _ in range(5)]
    bad = [rng.randrange(model.config.vocab_size) for _ in range(5)]
    group = ScoredGroup(
        prompt_index=0,
        samples=[
            make_sample(prompt, good, behaviour_logprobs(model, prompt, good, 1.0), reward=1.0),
            make_sample(prompt, bad, behaviour_logprobs(model, prompt, bad, 1.0), reward=0.0, sample_index=1),
        ],
    )
    trainer = make_trainer(model)

    result = trainer.train_step(TrainBatch(step=0, groups=[group]))

    assert result.updated and result.metrics["skipped_update"] == 0.0
    assert result.metrics["advantage_abs_mean"] == pytest.approx(1.0, abs=1e-4)
    good_after = behaviour_logprobs(model, prompt, good, 1.0)
    bad_after = behaviour_logprobs(model, prompt, bad, 1.0)
    assert sum(good_after) > sum(group.samples[0].logprobs)
    assert sum(bad_after) < sum(group.samples[1].logprobs)


@pytest.mark.parametrize("poison", ["nan_behaviour_logprob", "inf_reward"])
def test_non_finite_loss_skips_the_update(model, poison):
    trainer = make_trainer(model)
    assert trainer.train_step(make_batch(model, seed=1)).updated  # so the optimizer has state to protect
    before, optimizer_before = weights(model), copy.deepcopy(trainer.optimizer.state_dict())

    batch = make_batch(model, seed=2)
    sample = batch.groups[1].samples[2]
    if poison == "nan_behaviour_logprob":
        sample.logprobs[-1] = float("nan")
    else:
        sample.reward = math.inf
    with capture_logs() as logs:
        result = trainer.train_step(batch)

    assert not result.updated and result.metrics["skipped_update"] == 1.0
    assert not math.isfinite(result.metrics["loss"])
    assert any(entry["log_level"] == "warning" and "non-finite" in entry["event"] for entry in logs)
    assert_same_weights(model, before)
    assert_same_optimizer_state(trainer.optimizer.state_dict(), optimizer_before)
    assert all(p.grad is None for p in model.parameters())


def test_masked_samples_take_no_part_in_the_step(base_model):
    batch = make_batch(base_model, seed=4)
    poisoned = copy.deepcopy(batch)
    extra = copy.deepcopy(poisoned.groups[0].samples[0])
    extra.completion_token_ids = extra.completion_token_ids * 4  # longest sample: would change padding
    extra.logprobs = [float("nan")] * len(extra.completion_token_ids)
    extra.reward, extra.masked, extra.mask_reason = math.inf, True, "reward_error"
    poisoned.groups[0].samples.append(extra)

    models = [copy.deepcopy(base_model), copy.deepcopy(base_model)]
    clean = make_trainer(models[0], micro_batch_size=4).train_step(batch)
    dirty = make_trainer(models[1], micro_batch_size=4).train_step(poisoned)

    assert dirty.updated and dirty.metrics["num_masked_samples"] == 1.0
    assert dirty.metrics["num_samples"] == clean.metrics["num_samples"] + 1
    assert dirty.metrics["loss"] == clean.metrics["loss"]
    assert_same_weights(models[1], weights(models[0]))


def test_batch_without_trainable_tokens_is_skipped(model):
    batch = make_batch(model, groups=1, group_size=2)
    for sample in batch.samples:
        sample.masked = True
    trainer = make_trainer(model)
    before = weights(model)

    result = trainer.train_step(batch)

    assert not result.updated and result.metrics["skipped_update"] == 1.0
    assert result.metrics["num_loss_tokens"] == 0.0
    assert_same_weights(model, before)
    assert trainer.optimizer.state_dict()["state"] == {}


def test_kl_penalty_to_the_initial_policy(base_model):
    assert make_trainer(copy.deepcopy(base_model)).reference_model is None
    assert "kl" not in make_trainer(copy.deepcopy(base_model)).train_step(make_batch(base_model)).metrics

    model = copy.deepcopy(base_model)
    trainer = make_trainer(model, kl_coef=0.5, lr=1e-2)
    initial = weights(model)
    first = trainer.train_step(make_batch(base_model))
    second = trainer.train_step(make_batch(base_model, seed=1))

    # All rewards equal: zero advantages, so the KL penalty is the whole loss and the only gradient.
    constant = make_batch(base_model, seed=2)
    for sample in constant.samples:
        sample.reward = 1.0
    third = trainer.train_step(constant)

    assert first.updated and second.updated and third.updated
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert second.metrics["kl"] > 1e-4
    assert third.metrics["advantage_abs_mean"] == 0.0
    assert third.metrics["loss"] == pytest.approx(0.5 * third.metrics["kl"], rel=1e-5)
    assert third.metrics["grad_norm"] > 0
    assert_same_weights(trainer.reference_model, initial)
    assert all(not p.requires_grad for p in trainer.reference_model.parameters())


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(base_model, tmp_path):
    model = copy.deepcopy(base_model)
    trainer = make_trainer(model, weight_decay=0.01)
    trainer.train_step(make_batch(base_model, seed=5))
    torch.randint(0, 100, (3,), generator=trainer.generator)  # advance the RNG past its seed
    trainer.save_checkpoint(tmp_path)
    snapshot = copy.deepcopy(trainer.state_dict())

    restored = make_trainer(copy.deepcopy(base_model), weight_decay=0.01)
    restored.load_checkpoint(tmp_path)

    assert_same_weights(restored.model, snapshot["model"])
    assert_same_optimizer_state(restored.optimizer.state_dict(), snapshot["optimizer"])
    assert torch.equal(restored.generator.get_state(), snapshot["rng_state"])
    # Tied weights stay tied after loading, and the directory is a loadable Hugging Face model.
    assert restored.model.lm_head.weight.data_ptr() == restored.model.model.embed_tokens.weight.data_ptr()
    assert_same_weights(AutoModelForCausalLM.from_pretrained(tmp_path), snapshot["model"])
    # Both continue identically.
    next_batch = make_batch(base_model, seed=6)
    trainer.train_step(next_batch)
    restored.train_step(next_batch)
    assert_same_weights(restored.model, weights(trainer.model))

    # The in-memory state dict round-trips too.
    in_memory = make_trainer(copy.deepcopy(base_model), weight_decay=0.01)
    in_memory.load_state_dict(copy.deepcopy(snapshot))
    assert_same_weights(in_memory.model, snapshot["model"])
    assert_same_optimizer_state(in_memory.optimizer.state_dict(), snapshot["optimizer"])


def test_broken_checkpoints_raise_checkpoint_error(model, tmp_path):
    trainer = make_trainer(model)
    trainer.save_checkpoint(tmp_path / "good")
    before = weights(model)

    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        trainer.load_checkpoint(tmp_path / "missing")

    corrupt = tmp_path / "corrupt"
    trainer.save_checkpoint(corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        trainer.load_checkpoint(corrupt)

    truncated = tmp_path / "truncated"
    trainer.save_checkpoint(truncated)
    data = (truncated / "optimizer.pt").read_bytes()
    (truncated / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read .*optimizer.pt"):
        trainer.load_checkpoint(truncated)

    (tmp_path / "no_optimizer").mkdir()
    (tmp_path / "no_optimizer" / "model.safetensors").write_bytes(
        (tmp_path / "good" / "model.safetensors").read_bytes()
    )
    with pytest.raises(CheckpointError, match="has no optimizer.pt"):
        trainer.load_checkpoint(tmp_path / "no_optimizer")

    other = make_trainer(
        AutoModelForCausalLM.from_config(
            model.config.__class__(**{**model.config.to_dict(), "hidden_size": 32, "head_dim": 8})
        )
    )
    other.save_checkpoint(tmp_path / "other")
    with pytest.raises(CheckpointError, match="does not match the model"):
        trainer.load_checkpoint(tmp_path / "other")

    assert_same_weights(model, before)


def test_named_weights_are_the_hf_state_dict(model):
    trainer = make_trainer(model)
    named = dict(trainer.named_weights())
    assert named.keys() == model.state_dict().keys()
    assert "lm_head.weight" in named and "model.embed_tokens.weight" in named
    assert all(not tensor.requires_grad for tensor in named.values())
