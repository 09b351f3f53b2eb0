"""OpenEnv environments (``env.kind = "openenv"``, ``openenv-core`` 0.3): an environment server, reset and
stepped over its own client, the model's actions sampled through rollflow's client.

The server is at ``env.url``, or rollflow starts it: ``env.server`` (an ASGI app, ``module:app``, imported
from ``env.server_dir``) runs under uvicorn in a child process on a free loopback port, waited for on its
``/health`` for ``env.server_start_timeout_s``, and stopped with the run. A trajectory opens its own
environment session (``GenericEnvClient``, a WebSocket: one environment instance per session), resets it and
then, for up to ``env.max_turns`` turns, asks the model (an OpenAI client at the trajectory's TITO session)
with the observation as the user's message, steps the environment with the reply as the action's
``env.action_key`` field, and stops when the environment says it is done. The reward is the sum of the
environment's step rewards. A server that refuses the connection or drops it mid-episode fails the
trajectory (``env_errors``), never scores it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.errors import ConfigError, EnvError, MissingExtraError
from rollflow.rollout.envs.base import ENV_TASK, EnvOutcome, EnvTasks
from rollflow.rollout.tasks import TaskItem

if TYPE_CHECKING:
    from rollflow.config import EnvConfig
    from rollflow.processes import CommandChild
    from rollflow.rollout.agent import AgentTask

log = structlog.get_logger(__name__)

INSTALL = "pip install 'rollflow[envs]'"


def observation_text(observation: dict[str, Any], key: str | None) -> str:
    """What the model is shown of an observation: its ``key`` field, else the whole of it as JSON."""
    if key is None:
        return json.dumps(observation, sort_keys=True, default=str)
    if key not in observation:
        raise EnvError(
            f"the observation has no field {key!r} (env.observation_key); it has {sorted(observation)}"
        )
    return str(observation[key])


class OpenEnvSource:
    """An OpenEnv server as an ``EnvSource`` (see the module docstring).

    Raises:
        MissingExtraError: openenv-core is not installed.
    """

    def __init__(self, config: EnvConfig, model: str):
        try:
            self._client_class = importlib.import_module("openenv.core.generic_client").GenericEnvClient
        except ImportError as error:
            raise MissingExtraError(f"env.kind = 'openenv' needs openenv-core: {INSTALL} ({error})") from None
        if config.server_dir is not None and not os.path.isdir(config.server_dir):
            raise ConfigError(f"env.server_dir = {config.server_dir!r} is not a directory")
        self.config = config
        self.model = model
        self.url = config.url.rstrip("/") if config.url else None
        self._server: CommandChild | None = None
        self.task = self.held_out(0, config.num_tasks or 1)

    def held_out(self, first: int, count: int) -> EnvTasks:
        """Tasks ``first .. first + count - 1``: resets with those seeds on the same server (OpenEnv has no
        dataset: task i is a reset with seed i; the prompt is the reset's observation). ``[eval]`` takes the
        seeds after the training ones."""
        name = self.config.id
        return EnvTasks(
            name,
            [
                TaskItem(messages=[{"role": "user", "content": f"{name} #{i}"}], metadata={ENV_TASK: i})
                for i in range(first, first + count)
            ],
            source=self,
        )

    async def __aenter__(self) -> OpenEnvSource:
        if self.config.server is not None:
            await self._start_server()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(5.0)

    async def _start_server(self) -> None:
        from rollflow.processes import start_command

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            self.config.server,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        if self.config.server_dir is not None:
            argv += ["--app-dir", self.config.server_dir]
        argv += ["--log-level", "warning"]
        self._server = await start_command(argv, name="openenv-server", env=dict(os.environ))
        self.url = f"http://127.0.0.1:{port}"
        await self._wait_healthy(self.config.server_start_timeout_s)
        log.info("openenv server started", url=self.url, app=self.config.server, pid=self._server.pid)

    async def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if self._server is not None and self._server.returncode is not None:
                    raise ConfigError(
                        f"env.server = {self.config.server!r} exited with status {self._server.returncode} "
                        "before it answered /health (check env.server and env.server_dir)"
                    )
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if loop.time() > deadline:
                    raise ConfigError(
                        f"env.server = {self.config.server!r} did not answer {self.url}/health within "
                        f"env.server_start_timeout_s = {timeout_s:g} s"
                    )
                await asyncio.sleep(0.1)  # a server coming up: poll its health endpoint

    async def rollout(self, base_url: str, task: AgentTask) -> EnvOutcome:
        """One episode: reset, then model turn and environment step until done or ``env.max_turns``."""
        import openai

        config = self.config
        total = 0.0
        async with (
            openai.AsyncOpenAI(base_url=base_url, api_key="rollflow", max_retries=0) as model,
            self._client_class(base_url=self.url) as env,
        ):
            result = await env.reset(seed=task.metadata[ENV_TASK])
            messages = [
                {"role": "user", "content": observation_text(result.observation, config.observation_key)}
            ]
            for turn in range(config.max_turns):
                reply = await model.chat.completions.create(
                    model=task.model or self.model, messages=messages, seed=task.seed + turn
                )
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await env.step({config.action_key: text})
                total += float(result.reward or 0.0)
                if result.done:
                    break
                messages.append(
                    {"role": "user", "content": observation_text(result.observation, config.observation_key)}
                )
        return EnvOutcome(reward=total, parts={"openenv": total})
