"""verifiers environments (``env.kind = "verifiers"``, ``verifiers`` 0.4, its ``verifiers.v1`` stack).

The environment is built by ``verifiers.load_environment`` from ``{"taskset": {"id": env.id}, **env.args}``
(narrowed to its own config class by ``resolve_env_config``), held open (``Env.serving()``: its interception
server and shared tool servers) for the whole run, and its taskset is the run's prompts. A trajectory is one
``Env.run_episode`` whose model calls reach the trajectory's TITO session (the episode's model client points
at a ``SessionRouter`` that routes each trace to its session), so its harness's every model call, turn after
turn and tool call after tool call, is sampled and recorded by rollflow. The reward is the episode's: the weighted sum of its tasks' ``@vf.reward`` scores, each logged as
``reward/NAME``. An episode that verifiers records as failed (an error on the episode or a trace, a scoring
error, its own deadline) is a failed trajectory, never a 0.

Departures from ``vf-eval``: no whole-episode retries of verifiers' own (``env.on_failure`` and
``env.max_retries`` decide, so every attempt is counted), and the sampling parameters are rollflow's
(``[sampling]``, enforced by the proxy). Verifiers 0.4 has one API (``verifiers.v1``); its built-in harnesses
bootstrap ``uv`` and their programs' dependencies from the network and default to the Prime cloud runtime,
so offline runs use an in-process harness (a ``vf.Harness`` the taskset module exports) and
``agent = {runtime = {type = "subprocess"}}`` in ``env.args``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollflow.errors import ConfigError, MissingExtraError
from rollflow.rollout.envs.base import ENV_TASK, EnvOutcome, EnvTasks, prompt_messages
from rollflow.rollout.tasks import TaskItem

if TYPE_CHECKING:
    from rollflow.config import EnvConfig
    from rollflow.rollout.agent import AgentTask

INSTALL = "pip install 'rollflow[envs]'"


def import_verifiers() -> Any:
    """``verifiers.v1``.

    Raises:
        MissingExtraError: verifiers is not installed (names the install command).
    """
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as error:
        raise MissingExtraError(f"env.kind = 'verifiers' needs verifiers: {INSTALL} ({error})") from None


def taskset_module(spec: str) -> str:
    """The importable module name of ``env.id``: a module name as given, or a ``.py`` file / package
    directory, whose parent directory is put on ``sys.path`` and on ``PYTHONPATH`` (verifiers starts a
    taskset's tool servers as ``python -m module`` subprocesses).

    Raises:
        ConfigError: a path that does not exist.
    """
    if not (spec.endswith(".py") or "/" in spec):
        return spec
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"env.id = {spec!r}: no such file or directory")
    parent = str(path.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if parent not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [parent, *paths] if p)
    return path.stem if path.is_file() else path.name


class VerifiersSource:
    """A verifiers environment as an ``EnvSource`` (see the module docstring).

    Args:
        config: the ``[env]`` section.
        model: the model name requests use (the proxy's).

    Raises:
        MissingExtraError: verifiers is not installed.
        ConfigError: the environment does not load (its id, its config), or has no tasks.
    """

    def __init__(self, config: EnvConfig, model: str):
        vf = import_verifiers()
        self.vf = vf
        self.model = model
        module = taskset_module(config.id)
        data = {**config.args, "taskset": {**config.args.get("taskset", {}), "id": module}}
        try:
            self.env = vf.load_environment(vf.resolve_env_config(data))
        except Exception as error:  # pydantic validation, import errors: the user's config
            raise ConfigError(
                f"env.id = {config.id!r}: verifiers could not load the environment "
                f"({type(error).__name__}: {error}); check env.id and [env.args]"
            ) from error
        self.name = config.id
        self.tasks = _take(self.env.taskset, config.num_tasks, config.id)
        # Every task a rollout may be asked for, by its index in the taskset (the training ones and
        # ``held_out``'s).
        self._by_index: dict[int, Any] = dict(enumerate(self.tasks))
        self.task = self._env_tasks(0, self.tasks)
        self._serving: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._router: Any = None
        self._client: Any = None

    def _env_tasks(self, first: int, tasks: list[Any]) -> EnvTasks:
        return EnvTasks(
            self.name,
            [
                TaskItem(
                    messages=prompt_messages(task.data.prompt, task.data.system_prompt),
                    metadata={ENV_TASK: first + offset},
                )
                for offset, task in enumerate(tasks)
            ],
            source=self,
        )

    def held_out(self, first: int, count: int) -> EnvTasks:
        """Blocking (it reads the taskset): tasks ``first .. first + count - 1`` of the taskset, run by this
        source (``[eval]``'s held-out tasks after the training ones).

        Raises:
            ConfigError: the taskset has no task from ``first`` on.
        """
        tasks = list(self.env.taskset.skip(first).take(count))
        if not tasks:
            raise ConfigError(
                f"env.id = {self.name!r} has no tasks after the env.num_tasks = {first} training ones to "
                "evaluate: lower env.num_tasks, or set eval.env_args to a held-out taskset"
            )
        self._by_index.update((first + offset, task) for offset, task in enumerate(tasks))
        return self._env_tasks(first, tasks)

    async def __aenter__(self) -> VerifiersSource:
        from rollflow.rollout.envs.session_router import SessionRouter

        self._router = await SessionRouter().__aenter__()
        # One endpoint config for every episode (see rollflow.rollout.envs.session_router).
        self._client = self.vf.EvalClientConfig(
            base_url=self._router.base_url, api_key_var="ROLLFLOW_UNUSED_API_KEY"
        )
        try:
            self._serving = self.env.serving()
            await self._serving.__aenter__()
        except BaseException:
            await self._router.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._serving is not None:
                serving, self._serving = self._serving, None
                await serving.__aexit__(*exc)
        finally:
            if self._router is not None:
                router, self._router = self._router, None
                await router.__aexit__(None, None, None)

    async def rollout(self, base_url: str, task: AgentTask) -> EnvOutcome:
        """One episode of the task ``task.metadata["env_task"]``, every model call of each of its traces
        routed to the trajectory's session at ``base_url``."""
        router = self._router
        if router is None:
            raise ConfigError("VerifiersSource.rollout needs the source entered (async with)")
        traces: list[str] = []

        def minted(trace: Any) -> None:  # before the trace's first model call
            traces.append(trace.id)
            router.route(trace.id, base_url)

        ctx = self.vf.ModelContext(model=task.model or self.model, client=self._client)
        try:
            episode = await self.env.run_episode(
                self._by_index[task.metadata[ENV_TASK]], ctx, on_trace=minted
            )
        finally:
            for trace_id in traces:
                router.unroute(trace_id)
        return episode_outcome(episode)


def episode_outcome(episode: Any) -> EnvOutcome:
    """An ``EnvOutcome`` of a finished verifiers ``Episode``: its traces' weighted rewards summed, each named
    reward's score, and the first error verifiers recorded (on the episode or any trace)."""
    errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
    timed_out = bool(episode.is_timeout) or any(trace.is_timeout for trace in episode.traces)
    unscored = [name for trace in episode.traces for name, reward in trace.rewards.items() if reward is None]
    if errors or not episode.ok or unscored:
        first = errors[0] if errors else None
        message = f"{first.type}: {first.message}" if first is not None else "the episode did not finish"
        if unscored and first is None:
            message = f"rewards not scored: {', '.join(unscored)}"
        return EnvOutcome(error=None if timed_out else message, timed_out=timed_out)
    parts: dict[str, float] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            parts[name] = parts.get(name, 0.0) + reward.score
    return EnvOutcome(reward=sum(trace.reward for trace in episode.traces), parts=parts)


def _take(taskset: Any, num_tasks: int | None, name: str) -> list[Any]:
    if num_tasks is not None:
        return list(taskset.take(num_tasks))
    if getattr(taskset, "INFINITE", False):
        raise ConfigError(f"env.id = {name!r} yields tasks forever: set env.num_tasks")
    return list(taskset)
