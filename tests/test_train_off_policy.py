"""Off-policy correction in the trainer (``trainer.off_policy``): truncated IS and decoupled PPO."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig, build_config
from rollflow.errors import ConfigError
from rollflow.messages import TrainBatch
from rollflow.models.tiny import ensure_tiny_model
from rollflow.train.advantages import compute_advantages
from rollflow.train.losses import ppo_clip_loss
from rollflow.train.off_policy import importance_weights
from rollflow.train.trainer import Trainer

from .helpers.training import logprobs_of, make_behaviour_batch, make_off_policy_trainer, perturbed

# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def base_model():
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model())


def expected_step(model, batch: TrainBatch, weight_of) -> tuple[float, dict[str, torch.Tensor]]:
    """Hand computation of the corrected loss and its gradient, on an independent copy of ``model``.

    Per loss token: ``-A * sg[w] * exp(logp - sg[logp])`` (the ratio to the proximal policy is 1 in value);
    ``weight_of(raw_weight)`` gives ``w``. The mean runs over all loss tokens of the step.
    """
    model = copy.deepcopy(model)
    terms = []
    for group in batch.groups:
        advantages = compute_advantages(
            [s.reward for s in group.samples], [True] * len(group.samples), "grpo"
        )
        for sample, advantage in zip(group.samples, advantages, strict=True):
            ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(sample.prompt_token_ids) - 1
            picked = logp[start : start + len(sample.completion_token_ids)].gather(
                -1, torch.tensor(sample.completion_token_ids).unsqueeze(-1)
            )[:, 0]
            raw = torch.exp(picked.detach() - torch.tensor(sample.logprobs))
            terms.append(-advantage * weight_of(raw) * torch.exp(picked - picked.detach()))
    loss = torch.cat(terms).mean()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def raw_weights(current, batch: TrainBatch) -> torch.Tensor:
    """``exp(current - behaviour)`` of every loss token, by hand."""
    return torch.tensor(
        [
            math.exp(p - b)
            for s in batch.samples
            for p, b in zip(
                logprobs_of(current, s.prompt_token_ids, s.completion_token_ids), s.logprobs, strict=True
            )
        ]
    )


def assert_same_grads(model, expected: dict[str, torch.Tensor]) -> None:
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- the weights, by hand


def test_importance_weights_truncate_or_filter_at_the_cap():
    proximal = torch.tensor([[0.0, 0.0, -1.0, math.log(3.0), 5.0]])
    behaviour = torch.tensor([[0.0, -1.0, 0.0, 0.0, float("nan")]])
    mask = torch.tensor([[True, True, True, True, False]])  # the NaN is off the mask: ignored

    tis = importance_weights(proximal, behaviour, mask, method="tis", cap=2.0)
    decoupled = importance_weights(proximal, behaviour, mask, method="decoupled", cap=2.0)
    uncapped = importance_weights(proximal, behaviour, mask, method="decoupled", cap=None)

    e = math.e
    torch.testing.assert_close(tis.raw, torch.tensor([[1.0, e, 1 / e, 3.0, 1.0]]))
    torch.testing.assert_close(tis.weights, torch.tensor([[1.0, 2.0, 1 / e, 2.0, 1.0]]))
    torch.testing.assert_close(decoupled.weights, torch.tensor([[1.0, 0.0, 1 / e, 0.0, 1.0]]))
    torch.testing.assert_close(uncapped.weights, tis.raw)
    assert tis.capped.tolist() == decoupled.capped.tolist() == [[False, True, False, True, False]]
    assert not uncapped.capped.any()


@pytest.mark.parametrize("corrupt", [float("nan"), float("-inf")])
def test_corrupt_behaviour_logprobs_give_nan_not_the_cap(corrupt):
    weights = importance_weights(
        torch.zeros(2), torch.tensor([0.0, corrupt]), torch.ones(2, dtype=torch.bool), method="tis", cap=2.0
    )
    assert weights.weights[0] == 1.0 and weights.weights[1].isnan()


def test_token_weights_scale_the_policy_term_only_on_the_mask():
    new = torch.zeros(3, requires_grad=True)
    mask = torch.tensor([True, True, False])
    result = ppo_clip_loss(
        new,
        new.detach(),
        torch.tensor([1.0, -2.0, 5.0]),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        token_weights=torch.tensor([0.5, 2.0, float("nan")]),
    )
    assert result.loss.item() == pytest.approx((-1.0 * 0.5 + 2.0 * 2.0) / 2)
    result.loss.backward()
    assert new.grad.tolist() == pytest.approx([-0.25, 2.0, 0.0])


# ---------------------------------------------------------------- the trainer


@pytest.mark.parametrize("off_policy", ["tis", "decoupled"])
def test_on_policy_the_correction_gives_the_same_update_as_none(base_model, off_policy):
    batch = make_behaviour_batch(base_model)
    runs = {}
    for name in ("none", off_policy):
        model = copy.deepcopy(base_model)
        metrics = (
            make_off_policy_trainer(model, name, decoupled_cap=1.5)
            .train_step(batch, policy_version=0)
            .metrics
        )
        runs[name] = metrics, {n: p.grad.clone() for n, p in model.named_parameters()}

    (none, none_grads), (corrected, corrected_grads) = runs["none"], runs[off_policy]
    assert corrected["loss"] == pytest.approx(none["loss"], abs=1e-5)
    assert corrected["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert corrected["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert corrected["is_truncated_fraction"] == 0.0 and corrected["behaviour_staleness_mean"] == 0.0
    assert "is_weight_mean" not in none  # no correction, no weights to report
    for name, grad in none_grads.items():
        torch.testing.assert_close(corrected_grads[name], grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("off_policy", ["tis", "decoupled"])
def test_stale_behaviour_is_weighted_and_capped_as_by_hand(base_model, off_policy):
    current = perturbed(base_model, seed=1)  # trained on since the sampler's version 0
    batch = make_behaviour_batch(base_model, seed=1)
    raw = raw_weights(current, batch)
    # A cap halfway between two middle weights: some tokens on each side, none near it.
    ordered = raw.sort().values
    middle = len(ordered) // 2
    cap = max(float(ordered[middle - 1] + ordered[middle]) / 2, 1.001)
    capped = raw > cap
    assert 0 < capped.sum() < len(raw) and raw.max() > 1.2  # the data really is off-policy
    if off_policy == "tis":
        trainer = make_off_policy_trainer(copy.deepcopy(current), "tis", tis_cap=cap)
        expected_loss, expected_grads = expected_step(current, batch, lambda w: w.clamp(max=cap))
    else:
        trainer = make_off_policy_trainer(copy.deepcopy(current), "decoupled", decoupled_cap=cap)
        expected_loss, expected_grads = expected_step(current, batch, lambda w: torch.where(w > cap, 0.0, w))

    metrics = trainer.train_step(batch, policy_version=3).metrics

    assert metrics["is_weight_mean"] == pytest.approx(raw.mean().item(), rel=1e-4)
    assert metrics["is_weight_max"] == pytest.approx(raw.max().item(), rel=1e-4)
    assert metrics["is_truncated_fraction"] == pytest.approx(capped.float().mean().item())
    assert metrics["behaviour_staleness_mean"] == 3.0
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["clip_fraction"] == 0.0
    assert_same_grads(trainer.model, expected_grads)


def test_mixed_version_trajectories_use_each_tokens_own_behaviour_logprob(base_model):
    versions = [base_model, perturbed(base_model, seed=2)]  # versions 0 and 1 sampled; the trainer is at 2
    current = perturbed(base_model, seed=3)
    batch = make_behaviour_batch(base_model, seed=3, groups=1, group_size=2)
    for sample in batch.samples:
        # Weights were updated mid-request: the first half came from version 0, the rest from version 1.
        n = len(sample.completion_token_ids)
        sample.policy_versions = [0] * (n // 2) + [1] * (n - n // 2)
        per_version = [logprobs_of(m, sample.prompt_token_ids, sample.completion_token_ids) for m in versions]
        sample.logprobs = [per_version[v][j] for j, v in enumerate(sample.policy_versions)]
    # A multi-turn sample: its last token is a tool token, outside the loss and of no version.
    tool = batch.samples[1]
    tool.loss_mask = [True] * (len(tool.completion_token_ids) - 1) + [False]
    tool.policy_versions[-1] = -1
    trained_versions = batch.samples[0].policy_versions + tool.policy_versions[:-1]
    raw = raw_weights(current, batch)
    loss_raw = torch.cat([raw[: len(batch.samples[0].logprobs)], raw[len(batch.samples[0].logprobs) : -1]])
    # Weighting whole trajectories by version 0 alone would give other weights: the check discriminates.
    assert not torch.allclose(
        raw, raw_weights(current, make_behaviour_batch(base_model, seed=3, groups=1, group_size=2))
    )

    metrics = (
        make_off_policy_trainer(copy.deepcopy(current), "tis", tis_cap=1e6)
        .train_step(batch, policy_version=2)
        .metrics
    )

    assert metrics["is_weight_mean"] == pytest.approx(loss_raw.mean().item(), rel=1e-4)
    assert metrics["is_weight_max"] == pytest.approx(loss_raw.max().item(), rel=1e-4)
    assert metrics["behaviour_staleness_mean"] == pytest.approx(
        sum(2 - v for v in trained_versions) / len(trained_versions)
    )
    assert metrics["num_loss_tokens"] == len(loss_raw)


@pytest.mark.parametrize(("off_policy", "corrupt"), [("tis", float("nan")), ("decoupled", float("-inf"))])
def test_non_finite_behaviour_logprobs_still_skip_the_step(base_model, off_policy, corrupt):
    model = copy.deepcopy(base_model)
    trainer = make_off_policy_trainer(model, off_policy, decoupled_cap=2.0)
    batch = make_behaviour_batch(base_model, seed=4, groups=1)
    batch.samples[1].logprobs[0] = corrupt
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    result = trainer.train_step(batch)

    assert not result.updated and not math.isfinite(result.metrics["loss"])
    assert "behaviour_staleness_mean" not in result.metrics  # no policy_version given
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert trainer.optimizer.state_dict()["state"] == {}


# ---------------------------------------------------------------- config


def test_auto_resolves_by_orchestrator_mode_and_the_trainer_takes_the_resolved_value(base_model):
    config = TrainerConfig()
    assert config.off_policy == "auto"
    assert config.resolved_off_policy("sync") == "none"
    assert config.resolved_off_policy("one_step") == config.resolved_off_policy("fully_async") == "tis"
    assert TrainerConfig(off_policy="decoupled").resolved_off_policy("sync") == "decoupled"
    assert TrainerConfig(off_policy="none").resolved_off_policy("fully_async") == "none"
    assert Trainer(base_model, config).off_policy == "none"  # outside the orchestrator: as in sync
    assert Trainer(base_model, config, off_policy="tis").off_policy == "tis"
    with pytest.raises(ValueError, match="resolve 'auto'"):
        Trainer(base_model, config, off_policy="auto")


def test_off_policy_config_rules():
    def errors(**trainer) -> str:
        with pytest.raises(ConfigError) as info:
            build_config({"trainer": trainer})
        return str(info.value)

    build_config({"trainer": {"off_policy": "decoupled", "decoupled_cap": 5.0}})
    build_config({"trainer": {"off_policy": "tis", "tis_cap": 1.0}})
    assert "trainer.tis_cap = 0.5 is below 1" in errors(tis_cap=0.5)
    assert "trainer.decoupled_cap = 1.0 must be > 1" in errors(off_policy="decoupled", decoupled_cap=1.0)
    message = errors(decoupled_cap=5.0)  # auto in sync mode resolves to none
    assert "trainer.decoupled_cap is set" in message and "'none'" in message and "'sync'" in message
    assert "resolves to 'tis'" in errors(off_policy="tis", decoupled_cap=5.0)
    assert "trainer.off_policy" in errors(off_policy="is")
