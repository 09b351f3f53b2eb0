"""Loss aggregation (``trainer.loss_agg``) and the KL estimators and placement (``trainer.kl_estimator``,
``trainer.kl_in``) against hand-written formulas."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollflow.train.advantages import compute_advantages, kl_penalised_advantages
from rollflow.train.aggregation import UpdateCounts, kl_estimate, token_loss_scale, update_counts
from rollflow.train.losses import ppo_clip_loss

from .helpers.training import logprobs_of, make_behaviour_batch, make_off_policy_trainer, make_sample

AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
ESTIMATORS = ["k1", "k2", "k3", "low_var_k3"]
CONSTANT = 6.0


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def hand_aggregate(per_sequence: list[list[float]], agg: str) -> float:
    """The update's loss from each sequence's per-token terms (sequences without tokens left out)."""
    sequences = [terms for terms in per_sequence if terms]
    if agg == "token_mean":
        return sum(sum(terms) for terms in sequences) / sum(len(terms) for terms in sequences)
    if agg == "seq_mean_token_mean":  # GRPO
        return sum(sum(terms) / len(terms) for terms in sequences) / len(sequences)
    if agg == "seq_mean_token_sum":
        return sum(sum(terms) for terms in sequences) / len(sequences)
    if agg == "constant":  # Dr. GRPO: masked_sum(..., dim=-1) / MAX_TOKENS, then the mean over the batch
        return sum(sum(terms) / CONSTANT for terms in sequences) / len(sequences)
    raise AssertionError(agg)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_each_aggregation_is_its_formula_however_the_update_is_split(agg):
    generator = torch.Generator().manual_seed(0)
    shape = (6, 7)
    new = (-2 + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    old = new.detach() + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape[0], 1, generator=generator, dtype=torch.float64).expand(shape)
    mask = torch.rand(shape, generator=generator) > 0.35
    mask[4] = False  # a sequence without loss tokens counts in no denominator
    mask[1] = True
    # The whole update's counts, as the trainer reduces them over every rank's micro-batches.
    tokens, rows = update_counts(mask)
    counts = UpdateCounts(loss_tokens=tokens, sequences=rows)
    assert (tokens, rows) == (int(mask.sum()), 5)

    # Two "ranks" of rows 0-2 and 3-5, each in two micro-batches: the parts' losses add up.
    loss = torch.zeros((), dtype=torch.float64)
    for part in (slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)):
        scale = token_loss_scale(mask[part], agg, counts, CONSTANT).double()
        loss = (
            loss
            + ppo_clip_loss(
                new[part],
                old[part],
                advantages[part],
                mask[part],
                clip_low=0.2,
                clip_high=0.3,
                loss_scale=scale,
            ).loss
        )
    loss.backward()

    ratio = torch.exp(new.detach() - old)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.3))
    per_sequence = [[per_token[i, t].item() for t in range(shape[1]) if mask[i, t]] for i in range(shape[0])]
    assert loss.item() == pytest.approx(hand_aggregate(per_sequence, agg), rel=1e-6)  # float32 scales
    # The gradient: each token's d(term)/d(logp) times its weight in the formula.
    hand = new.detach().clone().requires_grad_()
    hand_ratio = torch.exp(hand - old)
    hand_terms = torch.maximum(-advantages * hand_ratio, -advantages * hand_ratio.clamp(0.8, 1.3))
    hand_loss = hand_aggregate_tensor(hand_terms, mask, agg)
    hand_loss.backward()
    torch.testing.assert_close(new.grad, hand.grad, rtol=1e-6, atol=1e-12)


def hand_aggregate_tensor(terms: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    rows = [terms[i][mask[i]] for i in range(terms.shape[0]) if mask[i].any()]
    if agg == "token_mean":
        return torch.cat(rows).mean()
    if agg == "seq_mean_token_mean":
        return torch.stack([row.mean() for row in rows]).mean()
    if agg == "seq_mean_token_sum":
        return torch.stack([row.sum() for row in rows]).mean()
    return torch.stack([row.sum() / CONSTANT for row in rows]).mean()


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_the_trainer_minimises_the_chosen_aggregation(base_model, agg):
    """One on-policy update: loss and gradient are the aggregation of ``-A * pi / sg[pi]`` by hand."""
    batch = make_behaviour_batch(base_model, seed=11, groups=2, group_size=3)
    constant_norm = CONSTANT if agg == "constant" else None
    model = copy.deepcopy(base_model)
    result = make_off_policy_trainer(
        model, "none", loss_agg=agg, constant_norm=constant_norm, micro_batch_size=2
    ).train_step(batch)

    hand_model = copy.deepcopy(base_model)
    rows = []
    for group in batch.groups:
        rewards = [s.reward for s in group.samples]
        for sample, advantage in zip(
            group.samples, compute_advantages(rewards, [True] * len(rewards), "grpo"), strict=True
        ):
            ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
            logp = torch.log_softmax(hand_model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(sample.prompt_token_ids) - 1
            picked = logp[start : start + len(sample.completion_token_ids)].gather(
                -1, torch.tensor(sample.completion_token_ids)[:, None]
            )[:, 0]
            rows.append(-advantage * torch.exp(picked - torch.tensor(sample.logprobs)))
    terms = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(r), dtype=torch.bool) for r in rows], batch_first=True
    )
    hand_loss = hand_aggregate_tensor(terms, mask, agg)
    hand_loss.backward()

    assert result.updated and result.metrics["loss"] == pytest.approx(hand_loss.item(), abs=1e-6)
    for (name, parameter), hand_parameter in zip(
        model.named_parameters(), hand_model.parameters(), strict=True
    ):
        torch.testing.assert_close(parameter.grad, hand_parameter.grad, atol=1e-5, rtol=1e-4, msg=name)


def hand_kl(log_ratio: float, estimator: str) -> tuple[float, float]:
    """Schulman's estimators of KL(pi || pi_ref) with log_ratio = log pi - log pi_ref, and d/d log pi."""
    if estimator == "k1":
        return log_ratio, 1.0
    if estimator == "k2":
        return log_ratio**2 / 2, log_ratio
    if estimator == "k3":
        return math.exp(-log_ratio) + log_ratio - 1, 1 - math.exp(-log_ratio)
    # verl's low_var_kl: kl = ref - logp clamped to [-20, 20], then k3 clamped to [-10, 10].
    clamped = min(max(log_ratio, -20.0), 20.0)
    value = math.exp(-clamped) + clamped - 1
    inside = -20 < log_ratio < 20 and -10 < value < 10
    return min(max(value, -10.0), 10.0), (1 - math.exp(-clamped)) if inside else 0.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_kl_estimator_is_its_formula_with_its_gradient(estimator):
    log_ratios = [-25.0, -3.0, -0.5, 0.0, 0.3, 2.0, 12.0, 25.0]
    logprobs = torch.tensor(log_ratios, dtype=torch.float64).requires_grad_()
    reference = torch.zeros(len(log_ratios), dtype=torch.float64)
    values = kl_estimate(logprobs - 1.5, reference - 1.5, estimator)
    values.sum().backward()
    for index, log_ratio in enumerate(log_ratios):
        value, grad = hand_kl(log_ratio, estimator)
        assert values[index].item() == pytest.approx(value, rel=1e-12), (estimator, log_ratio)
        assert logprobs.grad[index].item() == pytest.approx(grad, rel=1e-12, abs=1e-300), (
            estimator,
            log_ratio,
        )
    if estimator == "low_var_k3":
        assert values.max().item() == 10.0, "one very unlikely token cannot dominate"


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_the_kl_term_of_the_loss_uses_the_estimator(estimator):
    generator = torch.Generator().manual_seed(2)
    new = (-1 + 0.2 * torch.randn(4, 5, generator=generator, dtype=torch.float64)).requires_grad_()
    ref = new.detach() + 0.4 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=generator) > 0.3
    zero = torch.zeros(4, 5, dtype=torch.float64)  # no policy term: the KL penalty is the whole loss
    result = ppo_clip_loss(
        new,
        new.detach(),
        zero,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        ref_logprobs=ref,
        kl_coef=0.3,
        kl_estimator=estimator,
    )
    estimates = [
        hand_kl((new[i, t] - ref[i, t]).item(), estimator)[0]
        for i in range(4)
        for t in range(5)
        if mask[i, t]
    ]
    assert result.kl.item() == pytest.approx(sum(estimates) / len(estimates), rel=1e-12)
    assert result.loss.item() == pytest.approx(0.3 * sum(estimates) / len(estimates), rel=1e-12)


def test_kl_penalised_advantages_by_hand():
    samples = [
        make_sample([1], [2], [0.0], reward=1.0, index=0, sample_index=0),
        make_sample([1], [2], [0.0], reward=0.0, index=0, sample_index=1),
        make_sample([1], [2], [0.0], reward=0.5, index=0, sample_index=2),
        make_sample([3], [4], [0.0], reward=1.0, index=7, sample_index=0),
        make_sample([3], [4], [0.0], reward=1.0, index=7, sample_index=1),
    ]
    samples[3].trajectory = samples[4].trajectory = 0  # one agent run composed into two samples
    kl_sums = [2.0, 0.0, 1.0, 4.0, 0.0]
    advantages = kl_penalised_advantages(samples, kl_sums, 0.1, "grpo_no_std")
    # Group 0: rewards 0.8, 0.0, 0.4 (mean 0.4). Group 7: one trajectory alone: a constant group.
    assert advantages == pytest.approx([0.4, -0.4, 0.0, 0.0, 0.0], abs=1e-12)
    # Without the penalty, group 7 is equal rewards too, and group 0 the rewards themselves.
    assert kl_penalised_advantages(samples, kl_sums, 0.0, "grpo_no_std") == pytest.approx(
        [0.5, -0.5, 0.0, 0, 0]
    )
    with pytest.raises(ValueError, match="one entry per sample"):
        kl_penalised_advantages(samples, kl_sums[:2], 0.1, "grpo")


def test_kl_in_the_reward_moves_the_advantages_and_leaves_the_loss_without_kl(base_model):
    model = copy.deepcopy(base_model)
    kl_coef, estimator = 0.5, "k3"
    trainer = make_off_policy_trainer(
        model,
        "none",
        kl_coef=kl_coef,
        kl_in="reward",
        kl_estimator=estimator,
        lr=1e-2,
        clip_low=10,
        clip_high=10,
    )
    first = trainer.train_step(make_behaviour_batch(base_model, seed=1))
    assert first.metrics["kl"] == pytest.approx(
        0.0, abs=1e-7
    )  # the policy is the reference before any update
    start = copy.deepcopy(model)  # the weights the second step starts from
    batch = make_behaviour_batch(base_model, seed=2, groups=3, group_size=3)
    second = trainer.train_step(batch)

    kl_total, tokens, advantages, loss_terms = 0.0, 0, [], []
    for group in batch.groups:
        token_kls, kl_sums = [], []
        for sample in group.samples:
            policy = logprobs_of(start, sample.prompt_token_ids, sample.completion_token_ids)
            reference = logprobs_of(
                trainer.reference_model, sample.prompt_token_ids, sample.completion_token_ids
            )
            kls = [hand_kl(p - r, estimator)[0] for p, r in zip(policy, reference, strict=True)]
            token_kls.append((policy, kls))
            kl_sums.append(sum(kls))
        rewards = [s.reward - kl_coef * kl for s, kl in zip(group.samples, kl_sums, strict=True)]
        group_advantages = compute_advantages(rewards, [True] * len(rewards), "grpo")
        for sample, advantage, (policy, kls) in zip(group.samples, group_advantages, token_kls, strict=True):
            advantages.append(advantage)
            kl_total += sum(kls)
            tokens += len(kls)
            # none: the ratio is against the behaviour logprobs (base_model's); no clip at this range.
            loss_terms += [-advantage * math.exp(p - b) for p, b in zip(policy, sample.logprobs, strict=True)]
    assert second.metrics["kl"] > 1e-4, "a step later the policy has left the reference"
    assert second.metrics["kl"] == pytest.approx(kl_total / tokens, rel=1e-4)
    assert second.metrics["advantage_abs_mean"] == pytest.approx(
        sum(abs(a) for a in advantages) / len(advantages), rel=1e-4
    )
    assert second.metrics["loss"] == pytest.approx(sum(loss_terms) / tokens, abs=1e-5)
    plain = compute_advantages([s.reward for s in batch.groups[0].samples], [True] * 3, "grpo")
    assert advantages[:3] != pytest.approx(plain, abs=1e-3), "the penalty changed the advantages"
