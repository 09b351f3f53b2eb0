"""Several optimizer updates per step (``trainer.ppo_epochs``, ``trainer.mini_batches``) on the real tiny
model: the ratio of later updates against a hand computation, the packing of mini-batches, the placements
(in process, child process, FSDP2 workers) and the config keys' bad inputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollflow.config import TrainerConfig, load_config
from rollflow.errors import ConfigError
from rollflow.messages import TrainBatch
from rollflow.orchestrator.packing import pack_batch, pack_for_trainer
from rollflow.train.advantages import compute_advantages

from .helpers.training import logprobs_of, make_behaviour_batch, make_off_policy_trainer, perturbed
from .helpers.training import make_batch as make_varied_batch


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


CLIP = 0.05  # a narrow clip range, so that one update of lr 1e-2 moves some ratios past it


def token_table(batch: TrainBatch, start_model, after_model, groups: slice = slice(None)) -> dict:
    """Per loss token of ``batch.groups[groups]``, by independent unpadded forwards: the advantage (GRPO
    within the whole group), the behaviour logprob, and the logprobs of ``start_model`` and ``after_model``."""
    table: dict[str, list[float]] = {"advantage": [], "behaviour": [], "start": [], "after": []}
    for group in batch.groups[groups]:
        rewards = [s.reward for s in group.samples]
        advantages = compute_advantages(rewards, [True] * len(rewards), "grpo")
        for sample, advantage in zip(group.samples, advantages, strict=True):
            prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
            table["advantage"] += [advantage] * len(completion)
            table["behaviour"] += sample.logprobs
            table["start"] += logprobs_of(start_model, prompt, completion)
            table["after"] += logprobs_of(after_model, prompt, completion)
    return {name: torch.tensor(values, dtype=torch.float64) for name, values in table.items()}


def hand_ppo(table: dict, off_policy: str, cap: float = 10.0) -> dict[str, torch.Tensor]:
    """PPO-clip per token by hand, against the start-of-step anchor of ``off_policy``."""
    anchor = table["behaviour"] if off_policy == "none" else table["start"]
    ratio = torch.exp(table["after"] - anchor)
    advantage = table["advantage"]
    weight = (
        torch.ones_like(ratio) if off_policy == "none" else torch.exp(table["start"] - table["behaviour"])
    )
    weight = weight.clamp(max=cap)
    clipped_ratio = ratio.clamp(1 - CLIP, 1 + CLIP)
    loss = weight * torch.maximum(-advantage * ratio, -advantage * clipped_ratio)
    clipped = ((advantage > 0) & (ratio > 1 + CLIP)) | ((advantage < 0) & (ratio < 1 - CLIP))
    log_ratio = table["after"] - anchor
    return {
        "ratio": ratio,
        "loss": loss,
        "clipped": clipped.double(),
        "approx_kl": torch.exp(log_ratio) - 1 - log_ratio,
    }


def trained(model, batch: TrainBatch, off_policy: str, **config):
    """A copy of ``model`` after one step on ``batch``, and the step's result."""
    copied = copy.deepcopy(model)
    result = make_off_policy_trainer(copied, off_policy, **config).train_step(batch)
    return copied, result


COMMON = dict(lr=1e-2, clip_low=CLIP, clip_high=CLIP, tis_cap=10.0)


@pytest.mark.parametrize("off_policy", ["none", "tis"])
def test_the_second_epochs_ratio_is_against_the_start_of_the_step_by_hand(base_model, off_policy):
    current = perturbed(base_model, seed=1)  # the sampler's version 0 is base_model: stale samples
    batch = make_behaviour_batch(base_model, seed=1, groups=2, group_size=4)
    # The first pass is exactly a one-update step: its weights are the second pass's policy.
    after_first, _ = trained(current, batch, off_policy, **COMMON)
    _, result = trained(current, batch, off_policy, ppo_epochs=2, **COMMON)
    metrics = result.metrics

    table = token_table(batch, current, after_first)
    expected = hand_ppo(table, off_policy)
    assert metrics["num_updates"] == 2.0 and result.updated
    assert metrics["ppo_epoch_2/ratio_mean"] == pytest.approx(expected["ratio"].mean().item(), rel=1e-5)
    assert metrics["ppo_epoch_2/loss"] == pytest.approx(expected["loss"].mean().item(), abs=1e-5)
    assert metrics["ppo_epoch_2/approx_kl"] == pytest.approx(expected["approx_kl"].mean().item(), abs=1e-6)
    assert metrics["ppo_epoch_2/clip_fraction"] == pytest.approx(expected["clipped"].mean().item(), abs=1e-6)
    assert metrics["ppo_epoch_2/clip_fraction"] > 0.05, "the clip must act in the second pass"
    if off_policy == "tis":
        # The proximal policy is the start of the step: ratio exactly 1 in the first pass, not after it.
        assert metrics["ppo_epoch_1/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["ppo_epoch_1/clip_fraction"] == 0.0
        start_weight = torch.exp(table["start"] - table["behaviour"])
        assert metrics["is_weight_mean"] == pytest.approx(start_weight.mean().item(), rel=1e-4)
    # Step aggregates: the mean of the passes.
    for name in ("loss", "clip_fraction", "ratio_mean", "approx_kl", "grad_norm"):
        passes = (metrics[f"ppo_epoch_1/{name}"], metrics[f"ppo_epoch_2/{name}"])
        assert metrics[name] == pytest.approx(sum(passes) / 2, rel=1e-9), name


def test_a_later_mini_batch_takes_its_ratio_against_the_start_of_the_step(base_model):
    current = perturbed(base_model, seed=2)
    batch = make_behaviour_batch(base_model, seed=2, groups=4, group_size=3)
    first_half = TrainBatch(step=0, groups=batch.groups[:2])
    after_first, _ = trained(current, first_half, "tis", **COMMON)
    _, result = trained(current, batch, "tis", mini_batches=2, **COMMON)
    metrics = result.metrics

    first = hand_ppo(token_table(batch, current, current, slice(0, 2)), "tis")
    second = hand_ppo(token_table(batch, current, after_first, slice(2, 4)), "tis")
    tokens = len(first["ratio"]) + len(second["ratio"])
    assert metrics["num_updates"] == 2.0 and metrics["num_loss_tokens"] == tokens
    assert "ppo_epoch_1/loss" not in metrics  # one pass: the step's aggregates only
    expected_ratio = (first["ratio"].sum() + second["ratio"].sum()).item() / tokens
    assert metrics["ratio_mean"] == pytest.approx(expected_ratio, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(second["clipped"].sum().item() / tokens, abs=1e-6)
    assert metrics["clip_fraction"] > 0
    # Each update's loss is its own mini-batch's token mean; the step reports their mean.
    expected_loss = (first["loss"].mean() + second["loss"].mean()).item() / 2
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)


def test_micro_batching_does_not_change_several_updates(base_model):
    batch = make_varied_batch(base_model, seed=3, groups=4, group_size=2)
    runs = []
    for micro_batch_size in (64, 3):
        model = copy.deepcopy(base_model)
        result = make_off_policy_trainer(
            model, "tis", micro_batch_size=micro_batch_size, ppo_epochs=2, mini_batches=2, lr=1e-2
        ).train_step(batch)
        runs.append((result.metrics, {name: t.clone() for name, t in model.state_dict().items()}))
    (metrics, after), (other_metrics, other_after) = runs
    assert metrics["num_micro_batches"] == 2 and other_metrics["num_micro_batches"] == 4
    for name in ("loss", "grad_norm", "clip_fraction", "ppo_epoch_2/ratio_mean", "entropy"):
        assert other_metrics[name] == pytest.approx(metrics[name], abs=1e-5), name
    for name, tensor in after.items():
        torch.testing.assert_close(other_after[name], tensor, atol=1e-4, rtol=0, msg=name)


def test_an_empty_mini_batch_is_no_update_and_a_non_finite_one_is_skipped_alone(base_model):
    batch = make_behaviour_batch(base_model, seed=4, groups=4, group_size=2)
    for sample in batch.groups[1].samples:
        sample.masked = True  # mini-batch 2 of 4 has nothing to train
    batch.groups[3].samples[0].logprobs[0] = float("nan")  # mini-batch 4's loss is not finite
    result = make_off_policy_trainer(
        copy.deepcopy(base_model), "tis", mini_batches=4, ppo_epochs=2
    ).train_step(batch)
    assert result.updated and result.metrics["skipped_update"] == 0.0
    assert result.metrics["num_updates"] == 4.0  # 2 passes x (4 mini-batches - 1 empty - 1 non-finite)


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_mini_batches_are_whole_groups_in_order_with_the_same_passes_on_every_rank(base_model, num_ranks):
    batch = make_varied_batch(base_model, seed=5, groups=6, group_size=3)
    packed = pack_batch(batch, num_ranks=num_ranks, micro_batch_size=2, mini_batches=3)
    sizes = packed.ranks[0].mini_batch_sizes
    assert len(sizes) == 3 and all(rank.mini_batch_sizes == sizes for rank in packed.ranks)
    for mini_batch in range(3):
        groups = set()
        for rank in packed.ranks:
            indices = rank.mini_batch_slices()[mini_batch]
            groups |= {item.sample.prompt_index for k in indices for item in rank.micro_batches[k]}
        assert groups == {2 * mini_batch, 2 * mini_batch + 1}, "two whole groups each, in batch order"
    assert sorted((s.prompt_index, s.sample_index) for s in packed.samples) == [
        (g, s) for g in range(6) for s in range(3)
    ]
    assert packed.metrics["num_micro_batches"] == sum(sizes)
    # One mini-batch packs exactly as before: no sizes, one slice of everything.
    single = pack_batch(batch, num_ranks=num_ranks, micro_batch_size=2)
    assert single.ranks[0].mini_batch_sizes == []
    assert single.ranks[0].mini_batch_slices() == [range(len(single.ranks[0].micro_batches))]


def test_mini_batches_that_do_not_divide_the_groups_name_the_key(base_model):
    batch = make_varied_batch(base_model, seed=6, groups=3, group_size=2)
    with pytest.raises(ValueError, match=r"trainer\.mini_batches = 2 does not divide the 3 prompt groups"):
        pack_for_trainer(batch, TrainerConfig(mini_batches=2))


# ---------------------------------------------------------------- placements


@pytest.mark.slow
def test_fsdp2_workers_take_the_same_updates_as_one_trainer(tiny_model_dir, base_model):
    """Two ranks split every mini-batch; both take every update, normalised over the whole mini-batch.
    (A child process, ``placement = "process"``, runs this same ``Trainer`` on the same ``RankBatch``.)"""
    from rollflow.train.process import TrainerSpec
    from rollflow.train.trainer import Trainer
    from rollflow.train.workers import TrainerWorkers

    config = dict(micro_batch_size=2, ppo_epochs=2, mini_batches=2, clip_low=CLIP, clip_high=CLIP)

    def spec(**extra) -> TrainerSpec:
        return TrainerSpec(
            model_dir=tiny_model_dir,
            config=TrainerConfig(**config, **extra),
            temperature=1.0,
            pad_token_id=0,
            seed=0,
            off_policy="tis",
        )

    single = Trainer(copy.deepcopy(base_model), **spec().trainer_kwargs())
    batch = make_varied_batch(base_model, seed=7, groups=4, group_size=3)
    expected = single.train_step(pack_for_trainer(batch, single.config, 1), policy_version=0)
    assert expected.metrics["ppo_epoch_2/clip_fraction"] > 0
    workers = TrainerWorkers(spec(num_workers=2))
    try:
        packed = pack_for_trainer(batch, TrainerConfig(**config, num_workers=2), 2)
        assert all(len(rank.mini_batch_sizes) == 2 for rank in packed.ranks)
        actual = workers.train_step(packed, policy_version=0)
        assert actual.metrics["num_updates"] == 4.0
        for name in ("loss", "grad_norm", "ppo_epoch_2/clip_fraction", "ppo_epoch_2/ratio_mean", "entropy"):
            assert actual.metrics[name] == pytest.approx(expected.metrics[name], abs=1e-5), name
        full = dict(workers.named_weights())
        # As test_trainer_workers' first step from the same weights (measured: 1.6e-5 after four updates).
        for name, tensor in single.named_weights():
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-4, msg=name)
    finally:
        workers.close()


@pytest.mark.slow
@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_a_run_in_a_trainer_process_logs_each_pass(tmp_path):
    from rollflow import Orchestrator

    from .helpers.runs import read_jsonl, small_config

    # In a child process (``placement = "process"``): the same updates travel through its pipe.
    config = small_config(
        tmp_path,
        "orchestrator.steps=2",
        "trainer.ppo_epochs=2",
        "trainer.mini_batches=2",
        "trainer.lr=1e-2",
        "trainer.placement='process'",
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    assert [m["num_updates"] for m in metrics] == [4.0, 4.0]
    for m in metrics:
        assert m["logprob_mismatch"] < 1e-4, "measured at the start of the step, before any update"
        assert {"ppo_epoch_1/clip_fraction", "ppo_epoch_2/approx_kl"} <= m.keys()
    assert read_jsonl(config.run_dir / "metrics.jsonl")[-1]["ppo_epoch_2/ratio_mean"] > 0


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.ppo_epochs=0", r"invalid value for 'trainer\.ppo_epochs'"),
        ("trainer.ppo_epochs=-2", r"invalid value for 'trainer\.ppo_epochs'"),
        ("trainer.ppo_epochs='two'", r"invalid value for 'trainer\.ppo_epochs'"),
        ("trainer.ppo_epochs=1.5", r"invalid value for 'trainer\.ppo_epochs'"),
        ("trainer.mini_batches=0", r"invalid value for 'trainer\.mini_batches'"),
        ("trainer.mini_batches=-4", r"invalid value for 'trainer\.mini_batches'"),
        ("trainer.mini_batches=true", r"invalid value for 'trainer\.mini_batches'"),
        (
            "trainer.mini_batches=3",
            r"trainer\.mini_batches = 3 does not divide orchestrator\.prompts_per_step = 16",
        ),
        ("trainer.loss_agg='mean'", r"invalid value for 'trainer\.loss_agg'"),
        ("trainer.loss_agg=1", r"invalid value for 'trainer\.loss_agg'"),
        ("trainer.loss_agg='constant'", r"trainer\.loss_agg = 'constant' .* trainer\.constant_norm"),
        ("trainer.constant_norm=-8", r"invalid value for 'trainer\.constant_norm'"),
        ("trainer.constant_norm=0", r"invalid value for 'trainer\.constant_norm'"),
        ("trainer.constant_norm='max'", r"invalid value for 'trainer\.constant_norm'"),
        ("trainer.constant_norm=8", r"trainer\.constant_norm = 8\.0 only applies to trainer\.loss_agg"),
        ("trainer.kl_estimator='k4'", r"invalid value for 'trainer\.kl_estimator'"),
        ("trainer.kl_estimator=3", r"invalid value for 'trainer\.kl_estimator'"),
        ("trainer.kl_in='advantage'", r"invalid value for 'trainer\.kl_in'"),
        ("trainer.kl_in=false", r"invalid value for 'trainer\.kl_in'"),
        ("trainer.kl_in='reward'", r"trainer\.kl_in = 'reward' with trainer\.kl_coef = 0"),
    ],
)
def test_bad_values_of_the_update_keys_name_them(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [override])


def test_the_update_keys_accept_good_values():
    config = load_config(
        [],
        [
            "trainer.ppo_epochs=4",
            "trainer.mini_batches=8",
            "trainer.loss_agg='constant'",
            "trainer.constant_norm=8",
            "trainer.kl_estimator='low_var_k3'",
            "trainer.kl_in='reward'",
            "trainer.kl_coef=0.01",
        ],
    )
    trainer = config.trainer
    assert (trainer.ppo_epochs, trainer.mini_batches, trainer.constant_norm) == (4, 8, 8.0)
    defaults = TrainerConfig()
    assert (defaults.ppo_epochs, defaults.mini_batches, defaults.loss_agg) == (1, 1, "token_mean")
    assert (defaults.kl_estimator, defaults.kl_in, defaults.constant_norm) == ("k3", "loss", None)
    assert math.isclose(trainer.kl_coef, 0.01)
