"""``[env]``: environments users bring (a verifiers environment, an OpenEnv server) as the rollout source."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from rollflow.config.base import BASE_URL, NonNegative, Positive, PositiveFloat, Section

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig

ENV_KINDS = ("verifiers", "openenv")
"""The kinds ``env.kind`` takes. Harbor (``harbor``) would plug in the same way (its tasks as the data, its
agent's model client pointed at each trajectory's TITO session); its package needs Python >= 3.12."""


class EnvConfig(Section):
    """An environment as the rollout source: its tasks are the prompts, its own logic drives the model (one
    TITO session per trajectory, so every sample keeps exact tokens, masks and per-token versions) and its
    own scoring is the reward. When this section is present it replaces ``[data]``'s prompts and rewards and
    ``[agent]``. The group size is ``sampling.samples_per_prompt``."""

    kind: str
    """``verifiers`` (a verifiers taskset or environment, ``pip install 'rollflow[envs]'``) or ``openenv``
    (an OpenEnv environment server)."""
    id: str
    """verifiers: the taskset's module (``verifiers.load_environment``'s ``taskset.id``), or a path to its
    ``.py`` file or package directory. openenv: the environment's name (for prompts and logs)."""
    args: dict[str, Any] = {}
    """verifiers: the rest of the environment's config (its ``EnvConfig`` fields, e.g. ``{agent = {runtime
    = {type = "subprocess"}}}``, ``{taskset = {...}}``)."""
    url: str | None = None
    """openenv: the environment server's base URL; unset: rollflow starts the server (``server``)."""
    server: str | None = None
    """openenv: the server's ASGI app, ``module:app`` (e.g. ``echo_env.server.app:app`` of an environment
    made by ``openenv init echo_env``), run by rollflow with uvicorn on a free loopback port."""
    server_dir: str | None = None
    """openenv: the directory ``server`` is imported from (uvicorn's ``--app-dir``)."""
    server_start_timeout_s: PositiveFloat = 60.0
    """openenv: longest the started server may take to answer ``/health``."""
    action_key: str = "message"
    """openenv: the action field the model's reply fills (the echo environment's ``message``)."""
    observation_key: str | None = None
    """openenv: the observation field the model is shown as the user's message (unset: the observation as
    JSON)."""
    max_turns: Positive = 1
    """openenv: most model turns (environment steps) per trajectory; it ends sooner when the environment is
    done."""
    num_tasks: Positive | None = None
    """Tasks taken from the environment (unset: all of a finite taskset; required for endless ones)."""
    max_seq_len: Positive | None = None
    """Longest training sample in tokens (required): longer ones are cut, or masked with
    ``filter_overlong``."""
    filter_overlong: bool = False
    """A sample longer than ``max_seq_len`` is masked instead of cut."""
    mode: Literal["per_branch", "single_branch", "step_wise"] = "per_branch"
    """How a trajectory's message tree becomes samples (see ``rollflow.tito.composer``)."""
    timeout_s: PositiveFloat = 300.0
    """Longest one trajectory may run; past it the trajectory is cancelled, masked and counted
    (``env_timeouts``)."""
    max_concurrent: Positive | None = None
    """Most trajectories running at once over all prompts (unset: no limit of its own)."""
    on_failure: Literal["refill", "mask"] = "refill"
    """A trajectory that failed (the environment raised, timed out or lost its server; never scored 0):
    ``refill`` runs it again, up to ``max_retries`` times; ``mask`` keeps it masked. Either way a group left
    with fewer than ``min_group_samples`` good trajectories is dropped (every sample masked,
    ``env_dropped_groups``)."""
    max_retries: NonNegative = 2
    """Reruns of one failed trajectory with ``on_failure = "refill"`` (each counted, ``env_retries``)."""
    min_group_samples: Positive = 1
    """Fewest good trajectories a group keeps; below it the group is dropped (no advantage from noise)."""
    max_failure_rate: float = 0.5
    """Failed attempts over the last ``failure_window`` attempts above which the run stops with an error
    naming the causes (``EnvFailureRateError``) instead of training on what is left."""
    failure_window: Positive = 64
    """Attempts the failure rate is measured over (the run stops only once this many were made)."""


def env_errors(config: RunConfig) -> list[str]:
    env = config.env
    if env is None:
        return []
    errors = []
    if env.kind == "harbor":
        errors.append(
            "env.kind = 'harbor' is not supported yet: the harbor package needs Python >= 3.12; use "
            "'verifiers' or 'openenv'"
        )
    elif env.kind not in ENV_KINDS:
        errors.append(f"env.kind = {env.kind!r} must be one of {', '.join(repr(k) for k in ENV_KINDS)}")
    if not env.id.strip():
        errors.append("env.id is empty: name the environment (a verifiers taskset module, an OpenEnv client)")
    if env.kind == "openenv":
        if (env.url is None) == (env.server is None):
            errors.append(
                "env.kind = 'openenv' needs exactly one of env.url (a running server) and env.server"
            )
        if env.server is not None and ":" not in env.server:
            errors.append(f"env.server = {env.server!r} must name the server's ASGI app as 'module:app'")
        if env.url is not None and not BASE_URL.fullmatch(env.url):
            errors.append(f"env.url = {env.url!r} must be a base URL like 'http://127.0.0.1:8000'")
    elif env.url is not None or env.server is not None or env.server_dir is not None:
        errors.append(
            f"env.url, env.server and env.server_dir are for env.kind = 'openenv', not {env.kind!r}"
        )
    if env.max_seq_len is None:
        errors.append("env.max_seq_len must be set: the longest training sample in tokens")
    elif env.max_seq_len < config.sampling.max_tokens:
        errors.append(
            f"env.max_seq_len ({env.max_seq_len}) must be >= sampling.max_tokens ({config.sampling.max_tokens})"
        )
    if not (math.isfinite(env.max_failure_rate) and 0 < env.max_failure_rate <= 1):
        errors.append(f"env.max_failure_rate = {env.max_failure_rate} must be in (0, 1]")
    if env.min_group_samples > config.sampling.samples_per_prompt:
        errors.append(
            f"env.min_group_samples ({env.min_group_samples}) must be <= sampling.samples_per_prompt "
            f"({config.sampling.samples_per_prompt}): every group would be dropped"
        )
    if config.agent is not None:
        errors.append("[env] and [agent] are both set: the environment drives the model; remove one")
    if config.data.reward is not None or config.data.rewards:
        errors.append("data.reward and data.rewards are not used with [env]: the environment scores")
    if config.data.path is not None:
        errors.append("data.path is not used with [env]: the environment's tasks are the prompts")
    errors += _eval_errors(config)
    return errors


def _eval_errors(config: RunConfig) -> list[str]:
    """``[eval]`` with ``[env]``: held-out tasks of the environment (``eval.env_args`` or the tasks after
    ``env.num_tasks``)."""
    env, evaluation = config.env, config.eval
    if env is None or evaluation is None:
        return []
    errors = []
    for key in ("path", "split", "seed"):
        if getattr(evaluation, key) is not None:
            errors.append(
                f"eval.{key} is not used with [env]: the held-out tasks are the environment's "
                "(eval.env_args, or the tasks after env.num_tasks)"
            )
    if evaluation.env_args is not None and env.kind != "verifiers":
        errors.append(
            f"eval.env_args is for env.kind = 'verifiers', not {env.kind!r}: an OpenEnv environment's "
            "held-out tasks are the reset seeds after env.num_tasks"
        )
    if evaluation.env_args is None and env.num_tasks is None:
        errors.append(
            "[eval] with [env] needs env.num_tasks (the training tasks; eval takes the next eval.num_prompts) "
            "or eval.env_args (a held-out environment, e.g. [eval.env_args.taskset] split = 'test')"
        )
    return errors
