"""``RunConfig``: the whole run, its sections, and the rules that span sections."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec

from rollflow.config.agent import AgentConfig, agent_errors
from rollflow.config.base import Section
from rollflow.config.cluster import ClusterConfig, cluster_errors
from rollflow.config.data import DataConfig, data_errors
from rollflow.config.env import EnvConfig, env_errors
from rollflow.config.evaluation import EvalConfig
from rollflow.config.inference import (
    InferenceConfig,
    colocation_errors,
    inference_errors,
    server_option_errors,
)
from rollflow.config.logging import LoggingConfig
from rollflow.config.model import ModelConfig
from rollflow.config.orchestrator import CheckpointConfig, OrchestratorConfig
from rollflow.config.sampling import SamplingConfig
from rollflow.config.trainer import TrainerConfig, off_policy_errors, trainer_errors
from rollflow.config.weight_sync import WeightSyncConfig, weight_sync_errors
from rollflow.messages import sampling_error


class RunConfig(Section):
    name: str = "run"
    """Run name; the run directory is ``{output_dir}/{name}``, so one path component (not ``.`` or ``..``).
    One live run per run directory (``{run_dir}/run.lock``)."""
    output_dir: str = "runs"
    """Directory holding the run directories (relative to the working directory)."""
    seed: int = 0
    """Seeds the trainer and the samplers."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    agent: AgentConfig | None = None
    """Agent rollouts (``[agent]``); unset: single-turn generation."""
    env: EnvConfig | None = None
    """An environment as the rollout source (``[env]``); unset: ``[data]`` or ``[agent]``."""
    eval: EvalConfig | None = None
    """Held-out evaluation (``[eval]``); unset: none during training."""

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def cross_field_errors(config: RunConfig) -> list[str]:
    errors = []
    if not _RUN_NAME.fullmatch(config.name) or config.name in (".", ".."):
        errors.append(
            f"name = {config.name!r} must be a plain directory name (letters, digits, '.', '_', '-'; not "
            "empty, '.' or '..'): the run directory is {output_dir}/{name}"
        )
    if config.trainer.advantage == "rloo" and config.sampling.samples_per_prompt < 2:
        errors.append(
            "trainer.advantage = 'rloo' needs sampling.samples_per_prompt >= 2 "
            f"(got {config.sampling.samples_per_prompt}): the leave-one-out baseline needs another sample"
        )
    if config.sampling.max_tokens >= config.inference.max_model_len:
        errors.append(
            f"sampling.max_tokens ({config.sampling.max_tokens}) must be smaller than "
            f"inference.max_model_len ({config.inference.max_model_len}) to leave room for the prompt"
        )
    if config.sampling.temperature == 0:
        errors.append(
            "sampling.temperature = 0 samples greedily, which leaves no exploration for RL and no "
            "sampling distribution for the PPO ratio; use a temperature > 0 (1.0 is usual)"
        )
    errors += data_errors(config)
    errors += numeric_errors(config)
    errors += off_policy_errors(config)
    errors += trainer_errors(config)
    errors += inference_errors(config.inference)
    errors += server_option_errors(config.inference)
    errors += colocation_errors(config)
    errors += agent_errors(config)
    errors += env_errors(config)
    errors += cluster_errors(config)
    errors += weight_sync_errors(config)
    return errors


def _non_finite(value: Any, key: str) -> list[str]:
    """Keys under ``value`` (a section, a list or a number) holding inf or NaN."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [key]
    if isinstance(value, msgspec.Struct):
        return [
            bad
            for name in value.__struct_fields__
            for bad in _non_finite(getattr(value, name), f"{key}.{name}")
        ]
    if isinstance(value, list | tuple):
        return [bad for index, item in enumerate(value) for bad in _non_finite(item, f"{key}[{index}]")]
    return []


def numeric_errors(config: RunConfig) -> list[str]:
    """Numbers the sampler or the optimizer cannot use: inf or NaN anywhere (TOML spells them ``inf``, ``nan``),
    sampling values outside the float32 sampler's bounds, Adam betas outside [0, 1)."""
    errors = []
    for section in config.__struct_fields__:
        for key in _non_finite(getattr(config, section), section):
            errors.append(f"{key} must be a finite number (inf and nan are not)")
    sampling = config.sampling
    problem = sampling_error(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )
    # temperature = 0 has its own message (greedy leaves RL nothing to explore); non-finite ones are above.
    finite_temperature = math.isfinite(sampling.temperature) and math.isfinite(sampling.top_p)
    if problem is not None and sampling.temperature != 0 and finite_temperature:
        errors.append(f"sampling.{problem[1]}")
    for index, beta in enumerate(config.trainer.betas):
        if math.isfinite(beta) and not 0 <= beta < 1:
            errors.append(
                f"trainer.betas[{index}] = {beta} must be in [0, 1): Adam's moving averages decay by it "
                "each step (0.9 and 0.999 are usual)"
            )
    return errors


_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
