"""``[orchestrator]``: the schedule of generation and training, and ``[checkpoint]``."""

from __future__ import annotations

from typing import Literal

from rollflow.config.base import NonNegative, Positive, Section


class OrchestratorConfig(Section):
    mode: Literal["sync", "one_step", "fully_async"] = "sync"
    """``sync``: generate a step's batch, train on it, update weights. ``one_step``: generate step t + 1 while
    training step t (staleness ≤ 1). ``fully_async``: generation never waits for training, within
    ``max_staleness``."""
    prompts_per_step: Positive = 16
    """Prompts (groups of ``sampling.samples_per_prompt`` samples) trained in each step."""
    steps: Positive = 100
    """Optimizer steps of the run."""
    max_staleness: NonNegative = 2
    """``fully_async``: the most policy versions a trained sample may lag the weights being trained (checked
    per sample; staler groups are dropped and regenerated). ``sync`` uses 0 and ``one_step`` 1."""
    max_inflight: Positive = 64
    """Prompt groups generating at once (bounds the generation channel and the engines' queue)."""
    barrier: Literal["abort", "wait", "keep"] = "keep"
    """How a weight update treats requests in flight (async modes): ``abort`` them (see
    ``partial_rollouts``), ``wait`` for them to finish, or ``keep`` them frozen and continue on the new
    weights (their tokens then carry two policy versions)."""
    partial_rollouts: bool = True
    """After an ``abort``, continue the request from its partial tokens on the new weights (True), or throw
    the partial tokens away and sample the completion again (False)."""
    max_masked_steps: NonNegative = 3
    """Steps in a row with every sample masked (rewards that fail or time out, prompts too long, failed
    agents) after which the run stops with an error counting the reasons, instead of running to the end
    having trained nothing; 0 never stops."""


class CheckpointConfig(Section):
    every: NonNegative = 0
    """Save a checkpoint every N steps (0: only at the end of the run)."""
    keep: Positive = 2
    """Most recent checkpoints kept on disk."""
