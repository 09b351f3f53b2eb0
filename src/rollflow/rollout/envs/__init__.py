"""Environments users bring (``[env]``): a verifiers environment or an OpenEnv server as the rollout source.

``env_source(config, model)`` builds the ``EnvSource`` of ``config.kind`` (enter it with ``async with``);
``EnvGenerator`` runs it, one TITO session per trajectory, where failures are masked and counted, never
rewards. Harbor would plug in the same way (its tasks as ``EnvTasks``, its agent's model client at the
session URL); its package needs Python >= 3.12.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollflow.errors import ConfigError
from rollflow.rollout.envs.base import ENV_TASK, EnvOutcome, EnvSource, EnvTasks
from rollflow.rollout.envs.generator import EnvGenerator, FailureRate

if TYPE_CHECKING:
    from rollflow.config import EnvConfig

__all__ = ["ENV_TASK", "EnvGenerator", "EnvOutcome", "EnvSource", "EnvTasks", "FailureRate", "env_source"]


def env_source(config: EnvConfig, model: str) -> EnvSource:
    """Blocking (it loads the environment): the source ``config.kind`` names, not yet entered.

    Raises:
        ConfigError: an unknown kind, or the environment does not load.
        MissingExtraError: the kind's package is not installed.
    """
    if config.kind == "verifiers":
        from rollflow.rollout.envs.verifiers_env import VerifiersSource

        return VerifiersSource(config, model)
    if config.kind == "openenv":
        from rollflow.rollout.envs.openenv_env import OpenEnvSource

        return OpenEnvSource(config, model)
    raise ConfigError(f"env.kind = {config.kind!r} must be 'verifiers' or 'openenv'")
