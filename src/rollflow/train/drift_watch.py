"""A warning when the sampler drifts from the trainer for several steps in a row (torch-free: the
orchestrator runs it on each step's metrics).

``trainer.mismatch_kl_threshold`` and ``trainer.mismatch_kl_steps``: when ``off_policy/kl_k3`` (the
rollout-vs-trainer KL on the sampled tokens, ``off_policy_metrics.py``) is above the threshold for that many
consecutive steps, one warning is logged; the next comes only after the KL has fallen back to the threshold
or below and risen again (once per streak).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

KL_METRIC = "off_policy/kl_k3"


class MismatchWatch:
    """Counts consecutive steps whose rollout-vs-trainer KL is above ``threshold`` (0 disables)."""

    def __init__(self, threshold: float, steps: int) -> None:
        self.threshold = threshold
        self.steps = steps
        self.streak = 0
        self.warned = False

    def observe(self, metrics: Mapping[str, object]) -> bool:
        """Take one step's metrics; returns True when this step logged the warning. A step without the
        metric (a skipped step) leaves the streak as it was."""
        value = metrics.get(KL_METRIC)
        if self.threshold <= 0 or not isinstance(value, int | float) or math.isnan(value):
            return False
        if value <= self.threshold:
            self.streak, self.warned = 0, False
            return False
        self.streak += 1
        if self.streak < self.steps or self.warned:
            return False
        self.warned = True
        log.warning(
            "the sampler's policy has drifted from the trainer's: rollout-vs-trainer KL above "
            "trainer.mismatch_kl_threshold for trainer.mismatch_kl_steps steps; consider a behaviour "
            "correction (trainer.off_policy) or check the engine's logprobs",
            step=metrics.get("step"),
            kl_k3=value,
            threshold=self.threshold,
            steps=self.streak,
        )
        return True
