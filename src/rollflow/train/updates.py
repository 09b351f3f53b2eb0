"""Several optimizer updates per step (``trainer.ppo_epochs`` × ``trainer.mini_batches``): what stays fixed
across them and how their metrics become the step's.

PPO (Schulman et al. 2017) takes several updates on one batch of samples, each against the policy that
sampled it, and clips the ratio so that no update moves far from it. Here the anchor of every update's ratio is
fixed at the start of the step: the behaviour logprobs (``trainer.off_policy = "none"``) or the trainer's own
logprobs with the weights before the step's first update (``tis``, ``decoupled``: the proximal policy, whose
importance weights to the behaviour policy are then fixed for the step too). From the second update on the
ratio measures how far the step's updates moved the policy, and the clip acts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rollflow.train.losses import TokenLogprobs
    from rollflow.train.off_policy_metrics import DriftMeter

PASS_SUMS = ("clip_fraction", "ratio_mean", "approx_kl", "kl")
"""Per-update shares of a token mean over the step's tokens: their sum over a pass is the pass's mean."""
PASS_MEANS = ("loss", "grad_norm")
"""Per-update values: a pass reports their mean over its updates."""


@dataclass
class StepStart:
    """What every update of a step shares, per micro-batch: the policy at the start of the step (logprobs and
    entropy, detached) and the reference policy's logprobs (KL penalty)."""

    policy: list[TokenLogprobs | None]
    """None until known: a micro-batch whose first forward comes before any update gets it from that forward."""
    reference: list[torch.Tensor | None]
    """None without a KL penalty."""
    keep: bool
    """Whether later passes need the start logprobs (``ppo_epochs > 1``): first forwards then store theirs."""
    meter: DriftMeter | None = None
    """Collects the drift metrics of the step's first pass (``off_policy_metrics.py``)."""


def step_metrics(passes: Sequence[Sequence[dict[str, float]]]) -> dict[str, float]:
    """The step's metrics from each pass's updates' (already reduced over the ranks).

    ``PASS_SUMS`` and ``PASS_MEANS`` are averaged over the passes, and with several passes also reported per
    pass as ``ppo_epoch_N/<name>`` (N from 1). The other shares describe the start-of-step policy and come
    from the first pass only: summed over its updates, ``*_max`` the maximum. ``num_updates``: updates taken.
    """
    per_pass = []
    for pass_updates in passes:
        values = {name: _mean([update[name] for update in pass_updates]) for name in PASS_MEANS}
        for name in PASS_SUMS:
            if any(name in update for update in pass_updates):
                values[name] = math.fsum(update.get(name, 0.0) for update in pass_updates)
        per_pass.append(values)
    metrics = {name: _mean([values[name] for values in per_pass]) for name in per_pass[0]}
    if len(per_pass) > 1:
        for number, values in enumerate(per_pass, start=1):
            metrics.update((f"ppo_epoch_{number}/{name}", value) for name, value in values.items())
    first = passes[0]
    for name in sorted({name for update in first for name in update} - {*PASS_SUMS, *PASS_MEANS, "updated"}):
        found = [update[name] for update in first if name in update]
        metrics[name] = max(found) if name.endswith("_max") else math.fsum(found)
    metrics["num_updates"] = float(
        sum(update["updated"] for pass_updates in passes for update in pass_updates)
    )
    return metrics


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
