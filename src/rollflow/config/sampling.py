"""``[sampling]``: how completions are sampled."""

from __future__ import annotations

from rollflow.config.base import NonNegativeFloat, Positive, Probability, Section


class SamplingConfig(Section):
    samples_per_prompt: Positive = 8
    """Completions sampled per prompt (the group size for GRPO/RLOO baselines)."""
    max_tokens: Positive = 8
    """Completion budget of each sample, in tokens (a completion that reaches it ends with ``length``)."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature, within what the float32 sampler represents: [1e-5, 1e4]
    (``rollflow.messages.sampling_error``; 0, greedy, leaves RL nothing to explore and is refused)."""
    top_p: Probability = 1.0
    """Nucleus mass kept, in [1e-8, 1]; 1 disables it."""
    top_k: int = -1
    """0 or -1 disables top-k filtering; otherwise a positive count."""
