"""Group-relative advantages: one scalar per sample, computed within its prompt group.

- ``grpo`` (Shao et al. 2024, DeepSeekMath): ``(r - mean) / (std + eps)``. Departs from the paper in that
  ``std`` is the population standard deviation (ddof=0, so a group of one valid sample is defined) and a group
  whose valid rewards are all equal gets exact zeros instead of ``0 / eps`` rounding noise.
- ``grpo_no_std``: ``r - mean``, as in Dr. GRPO (Liu et al. 2025), which drops the std division because it
  up-weights groups that are nearly all right or all wrong. Dr. GRPO's other change is in the loss: each
  sequence's token sum divided by a constant (the generation budget) instead of by its length, which is
  ``trainer.loss_agg = "constant"`` with ``trainer.constant_norm`` (the default ``token_mean`` is DAPO's
  normaliser, not Dr. GRPO's; see ``aggregation.py``).
- ``rloo`` (Kool et al. 2019; Ahmadian et al. 2024): ``r - mean(other valid samples)``. Departs from the
  paper in that the advantage feeds the token-level PPO-clip loss rather than a plain REINFORCE gradient, and a
  group with a single valid sample (no leave-one-out baseline) gets advantage 0.

For every method, masked (invalid) samples get advantage 0 and are left out of the baseline, so a failed
reward never shifts its group's other advantages. Non-finite rewards of valid samples are propagated (they
give non-finite advantages), so the trainer sees them and skips the step instead of training on garbage; so
are rewards so large that the group's sums overflow (``math.fsum`` raises on them): that group's valid samples
get NaN. (The rewarder holds rewards within float32's range, where no sum of a group overflows.)

An agent run composed into several samples (one per branch or per step) is one unit of the baseline: its
samples share the trajectory's advantage instead of each weighing in on the group's mean and std.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal

AdvantageMethod = Literal["grpo", "rloo", "grpo_no_std"]

GRPO_STD_EPSILON = 1e-6


def compute_advantages(
    rewards: Sequence[float],
    valid: Sequence[bool],
    method: AdvantageMethod,
    *,
    trajectories: Sequence[Hashable | None] | None = None,
    epsilon: float = GRPO_STD_EPSILON,
) -> list[float]:
    """The advantage of each sample of one group, in the order given.

    Args:
        rewards: one reward per sample.
        valid: ``False`` for masked samples (advantage 0, not part of the baseline).
        method: ``grpo``, ``grpo_no_std`` or ``rloo`` (see the module docstring).
        trajectories: per sample, the agent trajectory it came from (None: a trajectory of its own). An
            agent run composed into several samples (branches, steps) counts once in the baseline, with
            its samples' mean reward, and each of its samples gets the trajectory's advantage; otherwise
            a run that branched more would weigh more in its group's mean and std.
        epsilon: added to the std in ``grpo`` so a near-constant group does not blow up.

    Raises:
        ValueError: the sequences differ in length, or ``method`` is unknown.
    """
    if len(rewards) != len(valid):
        raise ValueError(f"rewards and valid must have one entry per sample ({len(rewards)} != {len(valid)})")
    if trajectories is not None and len(trajectories) != len(rewards):
        raise ValueError(
            f"trajectories must have one entry per sample ({len(trajectories)} != {len(rewards)})"
        )
    # The units of the baseline: each trajectory once, each sample without one on its own.
    units: dict[Hashable, list[int]] = {}
    for index, ok in enumerate(valid):
        if ok:
            trajectory = None if trajectories is None else trajectories[index]
            units.setdefault(("sample", index) if trajectory is None else trajectory, []).append(index)
    if method not in ("grpo", "rloo", "grpo_no_std"):
        raise ValueError(f"unknown advantage method {method!r}; expected 'grpo', 'rloo' or 'grpo_no_std'")
    try:
        unit_rewards = [
            math.fsum(float(rewards[i]) for i in members) / len(members) for members in units.values()
        ]
        unit_advantages = _unit_advantages(unit_rewards, method, epsilon)
    except OverflowError:  # sums beyond float64 (mixed signs near 1e308): non-finite, as documented
        unit_advantages = [math.nan] * len(units)
    advantages = [0.0] * len(rewards)
    for advantage, members in zip(unit_advantages, units.values(), strict=True):
        for index in members:
            advantages[index] = advantage
    return advantages


def _unit_advantages(rewards: list[float], method: AdvantageMethod, epsilon: float) -> list[float]:
    """Advantages of baseline units that are all valid."""
    if method not in ("grpo", "rloo", "grpo_no_std"):
        raise ValueError(f"unknown advantage method {method!r}; expected 'grpo', 'rloo' or 'grpo_no_std'")
    count = len(rewards)
    # `max == min` is False when a NaN is present, so non-finite rewards fall through and propagate.
    if count == 0 or max(rewards) == min(rewards):
        return [0.0] * count
    mean = math.fsum(rewards) / count
    if method == "grpo":
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / count)
        return [(r - mean) / (std + epsilon) for r in rewards]
    if method == "grpo_no_std":
        return [r - mean for r in rewards]
    # rloo; count >= 2 here: a lone unit is a constant group and returned zeros above.
    total = math.fsum(rewards)
    return [r - (total - r) / (count - 1) for r in rewards]


def kl_penalised_advantages(
    samples: Sequence[Any], kl_sums: Sequence[float], kl_coef: float, method: AdvantageMethod
) -> list[float]:
    """``trainer.kl_in = "reward"``: each sample's advantage within its group (``prompt_index``) with
    ``reward - kl_coef * kl_sum`` as its reward, as verl's ``use_kl_in_reward`` does before its advantages.

    Args:
        samples: the trainable samples of whole groups (``rollflow.messages.Sample``; masked ones are left
            out, as they take no part in a baseline).
        kl_sums: per sample, the sum of its loss tokens' KL estimates to the reference policy.
        kl_coef: ``trainer.kl_coef``.
        method: ``trainer.advantage``.

    Raises:
        ValueError: ``kl_sums`` is not one per sample.
    """
    if len(kl_sums) != len(samples):
        raise ValueError(f"kl_sums must have one entry per sample ({len(kl_sums)} != {len(samples)})")
    groups: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        groups.setdefault(sample.prompt_index, []).append(index)
    advantages = [0.0] * len(samples)
    for members in groups.values():
        values = compute_advantages(
            [samples[i].reward - kl_coef * kl_sums[i] for i in members],
            [True] * len(members),
            method,
            trajectories=[samples[i].trajectory for i in members],
        )
        for index, value in zip(members, values, strict=True):
            advantages[index] = value
    return advantages
