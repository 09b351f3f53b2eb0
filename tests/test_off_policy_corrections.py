"""The off-policy menu: GSPO sequence ratios, CISPO, the ``[trainer.off_policy]`` table (TIS, MIS, geometric
masks, IcePop), the drift metrics and the warning, each checked against a hand computation."""

from __future__ import annotations

import copy
import math

import pytest
import structlog
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import OffPolicyTable, TrainerConfig, build_config
from rollflow.errors import ConfigError
from rollflow.messages import TrainBatch
from rollflow.models.tiny import ensure_tiny_model
from rollflow.train.advantages import compute_advantages
from rollflow.train.drift_watch import MismatchWatch
from rollflow.train.losses import policy_loss
from rollflow.train.off_policy import behaviour_correction

from .helpers.training import PackingTrainer, make_behaviour_batch, perturbed


@pytest.fixture(scope="module")
def base_model():
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model())


# ---------------------------------------------------------------- the weights, by hand

E = math.e


def table(kind: str, level: str = "token", **bounds) -> OffPolicyTable:
    return OffPolicyTable(kind=kind, level=level, **bounds).with_defaults()


def two_sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0 has token log-weights (0, 1, -1) and row 1 (1.5, 0.25) plus a padded position."""
    proximal = torch.tensor([[0.0, 1.0, -1.0], [1.5, 0.25, 7.0]])
    behaviour = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return proximal, behaviour, mask


def test_sequence_tis_truncates_the_product_and_shares_it():
    proximal, behaviour, mask = two_sequences()
    result = behaviour_correction(proximal, behaviour, mask, table("tis", "sequence", high=2.0))
    # Row products: exp(0) = 1 and exp(1.75) = 5.75 -> truncated to 2 on both of row 1's tokens.
    torch.testing.assert_close(result.weights, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 1.0]]))
    torch.testing.assert_close(
        result.raw, torch.tensor([[1.0, E, 1 / E], [math.exp(1.5), math.exp(0.25), 1.0]])
    )
    assert result.truncated.tolist() == [[False] * 3, [True, True, False]] and result.masked is None


def test_token_and_sequence_mis_mask_outside_the_bounds():
    proximal, behaviour, mask = two_sequences()
    token = behaviour_correction(proximal, behaviour, mask, table("mis", high=2.0))  # low = 1 / 2
    w = [[1.0, 0.0, 0.0], [0.0, math.exp(0.25), 1.0]]  # e and 1/e and e^1.5 leave [0.5, 2]
    torch.testing.assert_close(token.weights, torch.tensor(w))
    assert token.masked.tolist() == [[False, True, True], [True, False, False]]
    sequence = behaviour_correction(proximal, behaviour, mask, table("mis", "sequence", high=2.0))
    torch.testing.assert_close(sequence.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))
    assert sequence.masked.tolist() == [[False] * 3, [True, True, False]]


def test_geometric_masks_drop_sequences_by_their_mean_log_weight_and_keep_weight_one():
    proximal, behaviour, mask = two_sequences()
    # Geometric means: exp(0 / 3) = 1 and exp(1.75 / 2) = 2.4.
    kept = behaviour_correction(proximal, behaviour, mask, table("mis", "geometric", high=2.5))
    torch.testing.assert_close(kept.weights, torch.ones(2, 3))
    dropped = behaviour_correction(proximal, behaviour, mask, table("mis", "geometric", high=2.3))
    torch.testing.assert_close(dropped.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))


def test_icepop_keeps_the_token_weight_inside_its_default_band():
    proximal = torch.tensor([math.log(0.4), math.log(0.6), math.log(4.0), math.log(6.0)])
    result = behaviour_correction(proximal, torch.zeros(4), torch.ones(4, dtype=torch.bool), table("icepop"))
    torch.testing.assert_close(result.weights, torch.tensor([0.0, 0.6, 4.0, 0.0]))


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_a_corrupt_behaviour_logprob_makes_its_sequence_nan(level):
    proximal, behaviour, mask = two_sequences()
    behaviour[1, 0] = float("-inf")
    kind = "mis" if level == "geometric" else "tis"
    result = behaviour_correction(proximal, behaviour, mask, table(kind, level, high=3.0))
    assert result.weights[1, :2].isnan().all() and not result.weights[0].isnan().any()


# ---------------------------------------------------------------- the losses, by hand


def loss_inputs():
    new = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.8, -0.4], [-1.0, -0.3, float("nan")]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return new, old, advantages, mask


def test_gspo_clips_each_sequences_length_normalised_ratio():
    new, old, advantages, mask = loss_inputs()
    result = policy_loss(
        new, old, advantages, mask, clip_low=0.05, clip_high=0.05, ratio_level="sequence", num_step_tokens=5
    )
    result.loss.backward()
    # Row 0: mean log-ratio (0.1 - 0.2 - 0.1) / 3 = -0.0667, s = 0.9355: inside [0.95, 1.05]? No: clipped to
    # 0.95, and with A > 0 the minimum is the unclipped s, which keeps its gradient s * grad logp / token.
    s0 = math.exp(-0.2 / 3)
    # Row 1: (-0.5 + 0.1) / 2 = -0.2, s = 0.8187 < 0.95 with A < 0: -A * clip = 2 * 0.95 is the max: no gradient.
    s1 = math.exp(-0.2)
    expected = (3 * (-1.0 * s0) + 2 * (2.0 * 0.95)) / 5
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor([[-s0 / 5] * 3, [0.0, 0.0, 0.0]]))
    assert result.clip_fraction.item() == pytest.approx(2 / 5)
    assert result.ratio_mean.item() == pytest.approx((3 * s0 + 2 * s1) / 5, rel=1e-6)


def test_gspo_with_the_sequence_mean_aggregation_is_the_papers_gradient():
    """GSPO's own objective, ``mean_i min(s_i A_i, clip(s_i) A_i)``, by autograd on the sequence ratio."""
    new, old, advantages, mask = loss_inputs()
    scale = mask.float() / (mask.sum(dim=-1, keepdim=True) * 2)  # seq_mean_token_mean over 2 sequences
    result = policy_loss(
        new, old, advantages, mask, clip_low=0.5, clip_high=0.5, ratio_level="sequence", loss_scale=scale
    )
    result.loss.backward()
    by_hand = new.detach().clone().requires_grad_(True)
    terms = []
    for row, length in enumerate((3, 2)):
        s = torch.exp((by_hand[row, :length] - old[row, :length]).mean())
        a = advantages[row, 0]
        terms.append(-torch.minimum(s * a, s.clamp(0.5, 1.5) * a))
    expected = torch.stack(terms).mean()
    expected.backward()
    assert result.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(new.grad, by_hand.grad)


def test_cispo_bounds_the_weight_and_keeps_every_tokens_gradient():
    new, old, advantages, mask = loss_inputs()
    old[1, 0] = -2.0  # ratios 1.105, 0.819, 0.905 and 1.649, 1.105
    result = policy_loss(new, old, advantages, mask, clip_low=1.0, clip_high=0.2, objective="cispo")
    result.loss.backward()
    ratio = torch.exp(new.detach() - torch.nan_to_num(old))
    weight = torch.where(mask, ratio.clamp(max=1.2), 0.0)  # the lower bound 0 never acts
    # -sg[clip(r)] A grad logp: the clipped token (exp(0.5) = 1.65 > 1.2 on row 1) keeps its gradient.
    assert ratio[1, 0] > 1.2 and expected_nonzero(weight[1, 0])
    expected_grad = -weight * advantages / 5
    torch.testing.assert_close(new.grad, expected_grad)
    assert result.loss.item() == pytest.approx(float((-weight * advantages).sum() / 5), rel=1e-6)
    assert result.clip_fraction.item() == pytest.approx(1 / 5)  # only exp(0.5) leaves [0, 1.2]


def expected_nonzero(value: torch.Tensor) -> bool:
    return bool(value != 0)


def test_cispo_has_no_sequence_form():
    new, old, advantages, mask = loss_inputs()
    with pytest.raises(ValueError, match="cispo"):
        policy_loss(
            new, old, advantages, mask, clip_low=0.2, clip_high=0.2, objective="cispo", ratio_level="sequence"
        )


# ---------------------------------------------------------------- the trainer, by hand


def hand_step(current, batch: TrainBatch, weight_of, *, anchor: str, level: str, agg: str, clip: float):
    """The step's loss, gradients and drift metrics from unpadded forwards of a copy of ``current``.

    ``weight_of(log_w)`` maps one sequence's token log-weights (start minus behaviour) to its token weights;
    ``anchor`` is ``start`` (a correction) or ``behaviour`` (none); ``level`` the ratio's.
    """
    model = copy.deepcopy(current)
    terms, deltas = [], []
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
            behaviour = torch.tensor(sample.logprobs)
            log_w = picked.detach() - behaviour
            deltas.append(log_w)
            base = picked.detach() if anchor == "start" else behaviour
            if level == "sequence":
                ratio = torch.exp((picked.detach() - base).mean()) * torch.exp(picked - picked.detach())
            else:
                ratio = torch.exp(picked - base)
            per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
            terms.append(per_token * weight_of(log_w))
    if agg == "token_mean":
        loss = torch.cat(terms).mean()
    else:
        loss = torch.stack([term.mean() for term in terms]).mean()
    loss.backward()
    delta = torch.cat(deltas).double()
    drift = {
        "off_policy/kl_k1": float((-delta).mean()),
        "off_policy/kl_k3": float((torch.expm1(delta) - delta).mean()),
        "off_policy/ratio_p50": float(torch.quantile(delta, 0.5).exp()),
        "off_policy/ratio_p99": float(torch.quantile(delta, 0.99).exp()),
    }
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}, drift


CASES = {
    # name: (off_policy table or name, trainer options, hand weight, anchor, ratio level, aggregation)
    "tis_sequence": (
        OffPolicyTable(kind="tis", level="sequence", high=1.5),
        {},
        lambda log_w: torch.full_like(log_w, min(math.exp(float(log_w.sum())), 1.5)),
        "start",
        "token",
        "token_mean",
    ),
    "mis_geometric": (
        OffPolicyTable(kind="mis", level="geometric", high=1.02),
        {},
        lambda log_w: torch.full_like(log_w, float(abs(float(log_w.mean())) <= math.log(1.02))),
        "start",
        "token",
        "token_mean",
    ),
    "icepop": (
        OffPolicyTable(kind="icepop", low=0.9, high=1.1),
        {},
        lambda log_w: torch.where((log_w.exp() >= 0.9) & (log_w.exp() <= 1.1), log_w.exp(), 0.0),
        "start",
        "token",
        "token_mean",
    ),
    "gspo": (
        "none",
        {"ratio_level": "sequence", "loss_agg": "seq_mean_token_mean", "clip_low": 0.02, "clip_high": 0.02},
        lambda log_w: torch.ones_like(log_w),
        "behaviour",
        "sequence",
        "seq_mean_token_mean",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_step_matches_the_hand_computation(base_model, case):
    off_policy, options, weight_of, anchor, level, agg = CASES[case]
    current = perturbed(base_model, seed=1)  # trained on since the sampler's version 0
    batch = make_behaviour_batch(base_model, seed=1, groups=2, group_size=3)
    clip = options.get("clip_low", 0.2)
    expected_loss, expected_grads, drift = hand_step(
        current, batch, weight_of, anchor=anchor, level=level, agg=agg, clip=clip
    )
    config = {"max_grad_norm": 1e6, **options}
    trainer = PackingTrainer(
        copy.deepcopy(current), TrainerConfig(**config), pad_token_id=0, off_policy=off_policy
    )
    metrics = trainer.train_step(batch, policy_version=1).metrics

    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)
    for name, parameter in trainer.model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    for name, value in drift.items():
        assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    if case == "mis_geometric":
        # The bound was picked so that the batch has sequences on both sides of it.
        assert 0 < metrics["off_policy/masked_seq_fraction"] < 1
    if case == "tis_sequence":
        assert 0 < metrics["off_policy/truncated_seq_fraction"] < 1
    if case == "gspo":
        assert metrics["clip_fraction"] > 0  # the sequence clip acts against the behaviour logprobs


# ---------------------------------------------------------------- config and the warning


def config_error(**trainer) -> str:
    with pytest.raises(ConfigError) as info:
        build_config({"trainer": trainer})
    return str(info.value)


def test_the_table_refuses_what_no_reference_defines_naming_the_key():
    build_config({"trainer": {"off_policy": {"kind": "mis", "level": "geometric", "high": 1.001}}})
    build_config({"trainer": {"off_policy": {"kind": "tis", "level": "sequence"}, "ratio_level": "sequence"}})
    assert "trainer.off_policy.level = 'sequence' with trainer.off_policy.kind = 'icepop'" in config_error(
        off_policy={"kind": "icepop", "level": "sequence"}
    )
    assert "kind = 'tis'" in config_error(off_policy={"kind": "tis", "level": "geometric"})
    assert "trainer.off_policy.low = 0.5" in config_error(off_policy={"kind": "tis", "low": 0.5})
    assert "needs trainer.off_policy.high" in config_error(off_policy={"kind": "mis", "level": "geometric"})
    assert "trainer.off_policy.high = 1.0 must be above 1" in config_error(
        off_policy={"kind": "mis", "high": 1.0}
    )
    assert "trainer.off_policy.low = 1.2 must be below 1" in config_error(
        off_policy={"kind": "icepop", "low": 1.2}
    )
    assert "corrects nothing" in config_error(off_policy={"kind": "none", "high": 2.0})
    assert "set trainer.off_policy.high instead" in config_error(off_policy={"kind": "tis"}, tis_cap=3.0)
    assert "trainer.loss = 'cispo'" in config_error(loss="cispo", ratio_level="sequence")
    assert "trainer.off_policy.kind" in config_error(off_policy={"kind": "gspo"})


def test_the_names_are_tables_with_their_caps():
    config = build_config({"trainer": {"off_policy": "tis", "tis_cap": 3.0}}).trainer
    assert config.off_policy_correction("sync") == OffPolicyTable(kind="tis", high=3.0)
    auto = build_config({}).trainer
    assert auto.off_policy_correction("sync").kind == "none"
    assert auto.off_policy_correction("fully_async") == OffPolicyTable(kind="tis", high=2.0)
    written = build_config({"trainer": {"off_policy": {"kind": "mis", "level": "sequence"}}}).trainer
    assert written.resolved_off_policy("sync") == "mis"
    assert written.off_policy_correction("sync") == OffPolicyTable(
        kind="mis", level="sequence", low=0.5, high=2.0
    )


def test_the_mismatch_warning_comes_once_per_streak():
    watch = MismatchWatch(threshold=0.01, steps=3)
    kls = [0.02, 0.02, 0.005, 0.02, 0.02, 0.02, 0.03, 0.05, None, 0.0, 0.02, 0.02, 0.02]
    with structlog.testing.capture_logs() as logs:
        warned = [
            watch.observe({"step": step} if kl is None else {"step": step, "off_policy/kl_k3": kl})
            for step, kl in enumerate(kls)
        ]
    assert [step for step, fired in enumerate(warned) if fired] == [5, 12]
    assert [entry["step"] for entry in logs if entry["log_level"] == "warning"] == [5, 12]
    assert not any(MismatchWatch(0.0, 1).observe({"off_policy/kl_k3": 9.0}) for _ in range(3))
