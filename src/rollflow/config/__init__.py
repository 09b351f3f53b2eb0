"""Run configuration: msgspec Structs decoded from TOML, one module per section.

Precedence: defaults < TOML files, left to right < ``--set section.key=value`` overrides. Unknown keys are
errors naming the key path (``trainer.lrr``); cross-field rules name every field involved. Importing this
package never imports torch.

Each section (``model``, ``data``, ``inference`` …) lives in its own module with its validator;
``rollflow.config.run`` joins them into ``RunConfig`` and ``rollflow.config.loading`` reads, merges and
validates files. ``resolve_config`` (``rollflow.config.resolve``) turns every ``auto`` a config can decide
into a value before components see it. Every public name is re-exported here.
"""

from __future__ import annotations

from rollflow.config.agent import AgentConfig
from rollflow.config.base import Section
from rollflow.config.cluster import ClusterConfig
from rollflow.config.data import DataConfig, RewardSpec
from rollflow.config.env import EnvConfig
from rollflow.config.evaluation import EvalConfig
from rollflow.config.inference import API_KEY_ENV, InferenceConfig, api_key_or_env, resolve_api_key
from rollflow.config.loading import (
    CODE_SPEC_KEYS,
    FILE_PATH_KEYS,
    build_config,
    deep_merge,
    load_config,
    parse_override,
    read_toml,
    read_toml_or_json,
    resolve_file_paths,
    to_dict,
    to_json,
)
from rollflow.config.logging import LoggingConfig
from rollflow.config.mode_override import INFERENCE_MODE_ENV
from rollflow.config.model import ModelConfig
from rollflow.config.orchestrator import CheckpointConfig, OrchestratorConfig
from rollflow.config.resolve import resolve_config, starts_router
from rollflow.config.run import RunConfig
from rollflow.config.sampling import SamplingConfig
from rollflow.config.server_spec import ServerSpec
from rollflow.config.trainer import LoraConfig, OffPolicyTable, TrainerConfig
from rollflow.config.weight_sync import WeightSyncConfig

__all__ = [
    "API_KEY_ENV",
    "CODE_SPEC_KEYS",
    "FILE_PATH_KEYS",
    "INFERENCE_MODE_ENV",
    "AgentConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "InferenceConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OffPolicyTable",
    "OrchestratorConfig",
    "RewardSpec",
    "RunConfig",
    "SamplingConfig",
    "Section",
    "ServerSpec",
    "TrainerConfig",
    "WeightSyncConfig",
    "api_key_or_env",
    "build_config",
    "deep_merge",
    "load_config",
    "parse_override",
    "read_toml",
    "read_toml_or_json",
    "resolve_api_key",
    "resolve_config",
    "resolve_file_paths",
    "starts_router",
    "to_dict",
    "to_json",
]
