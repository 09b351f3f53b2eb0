"""Group-relative advantages: one scalar per sample, computed within its prompt group.

- ``grpo`` (Shao et al. 2024, DeepSeekMath): ``(r - mean) / (std + eps)``. Departs from the paper in that
  ``std`` is the population standard deviation (ddof=0, so a group of one valid sample is defined) and a group
  whose valid rewards are all equal gets exact zeros instead of ``0 / eps`` rounding noise.
- ``grpo_no_std``: ``r - mean``, as in Dr. GRPO (Liu et al. 2025), which drops the std division because it
  up-weights groups that are nearly all right or all wrong. Dr. GRPO's other change (no per-sequence length
  normalisation) is a property of the loss, where rollflow already takes a token mean over the whole step.
- ``rloo`` (Kool et al. 2019; Ahmadian et al. 2024): ``r - mean(other valid samples)``. Departs from the
  paper in that the advantage feeds the token-level PPO-clip loss rather than a plain REINFORCE gradient, and a
  group with a single valid sample (no leave-one-out baseline) gets advantage 0.

For every method, masked (invalid) samples get advantage 0 and are left out of the baseline, so a failed
reward never shifts its group's other advantages. Non-finite rewards of valid samples are propagated (they
give non-finite advantages), so the trainer sees them and skips the step instead of training on garbage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageMethod = Literal["grpo", "rloo", "grpo_no_std"]

GRPO_STD_EPSILON = 1e-6


def compute_advantages(
    rewards: Sequence[float],
    valid: Sequence[bool],
    method: AdvantageMethod,
    *,
    epsilon: float = GRPO_STD_EPSILON,
) -> list[float]:
    """The advantage of each sample of one group, in the order given.

    Args:
        rewards: one reward per sample.
        valid: ``False`` for masked samples (advantage 0, not part of the baseline).
        method: ``grpo``, ``grpo_no_std`` or ``rloo`` (see the module docstring).
        epsilon: added to the std in ``grpo`` so a near-constant group does not blow up.

    Raises:
        ValueError: ``rewards`` and ``valid`` differ in length, or ``method`` is unknown.
    """
    if len(rewards) != len(valid):
        raise ValueError(f"rewards and valid must have one entry per sample ({len(rewards)} != {len(valid)})")
    valid_rewards = [float(r) for r, ok in zip(rewards, valid, strict=True) if ok]
    advantages = [0.0] * len(rewards)
    count = len(valid_rewards)
    # `max == min` is False when a NaN is present, so non-finite rewards fall through and propagate.
    if count == 0 or max(valid_rewards) == min(valid_rewards):
        return advantages

    mean = math.fsum(valid_rewards) / count
    if method == "grpo":
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in valid_rewards) / count)

        def advantage(r: float) -> float:
            return (r - mean) / (std + epsilon)

    elif method == "grpo_no_std":

        def advantage(r: float) -> float:
            return r - mean

    elif method == "rloo":
        # count >= 2 here: a lone valid sample is a constant group and returned zeros above.
        total = math.fsum(valid_rewards)

        def advantage(r: float) -> float:
            return r - (total - r) / (count - 1)

    else:
        raise ValueError(f"unknown advantage method {method!r}; expected 'grpo', 'rloo' or 'grpo_no_std'")

    for index, (reward, ok) in enumerate(zip(rewards, valid, strict=True)):
        if ok:
            advantages[index] = advantage(float(reward))
    return advantages
