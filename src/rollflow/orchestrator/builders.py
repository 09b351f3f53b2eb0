"""One way to build a run's parts from its config, shared by ``rollflow run`` (the ``Orchestrator``),
``rollflow generate``, ``rollflow eval`` and ``rollflow proxy``, so that the commands cannot drift apart:

- ``load_chat``: the model's tokenizer and chat renderer;
- ``rollflow.inference.setup.get_inference_client``: the engines, servers and router ``[inference]`` asks for;
- ``build_barrier``: the weight barrier of ``[weight_sync]``;
- ``build_proxy``: a TITO proxy over a client, with ``[agent]``'s listener and request policy and the
  ``[sampling]`` defaults (``proxy_options``); ``build_agent_proxy``: the same in ``agent.proxy_workers``
  worker processes when that is set;
- ``open_generator``: the generator of the run (``[env]`` or ``[agent]`` sessions through the proxy, else
  single-turn); ``open_env``: the ``[env]`` environment, entered;
- ``push_policy``: checkpoint weights into the engines.

Components (``rollout``, ``tito``, ``inference``, ``weights``, ``train``) never import this package; it
imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from rollflow.config import RunConfig
from rollflow.errors import ConfigError

if TYPE_CHECKING:
    from rollflow.orchestrator.barrier import WeightBarrier
    from rollflow.rollout.agent import AgentGenerator
    from rollflow.tito.proxy import TITOProxy
    from rollflow.tito.workers import ProxyWorkers


def load_chat(config: RunConfig, model_dir: str | Path | None = None) -> tuple[Any, Any]:
    """Blocking: the tokenizer and chat renderer of ``config.model`` (``model_dir``: the resolved model
    directory, when the caller has it).

    Raises:
        ModelNotFoundError: ``model.path`` does not resolve to a local model.
        ConfigError: ``model.renderer`` does not resolve.
    """
    from rollflow.models.loading import create_chat_renderer, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(config.model.path) if model_dir is None else Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    return tokenizer, create_chat_renderer(tokenizer, config.model, model_dir)


def build_barrier(config: RunConfig, client: Any, rank0_address: str = "127.0.0.1") -> WeightBarrier:
    """The weight barrier of ``config.weight_sync`` over ``client``; ``rank0_address`` (the trainer rank 0's
    node) is where ``weight_sync.master_address = "auto"`` points. Its owner closes it."""
    from rollflow.config import resolve_config
    from rollflow.orchestrator.barrier import WeightBarrier

    return WeightBarrier.from_config(resolve_config(config), client, rank0_address)


def proxy_options(
    config: RunConfig, *, host: str | None = None, port: int | None = None, admin_token: str | None = None
) -> dict[str, Any]:
    """The ``TITOProxy`` keyword arguments ``config`` describes (``build_proxy``, and each of the
    ``agent.proxy_workers``): it listens on ``agent.host``:``agent.port`` (``host`` and ``port`` override
    them; 127.0.0.1 and a free port without ``[agent]``), advertises ``agent.advertise_url``, defaults
    requests to ``[sampling]`` and knows the engines' limits (``inference.max_batch_size``,
    ``max_model_len``, ``return_routed_experts``) and bounds its sessions (``agent.max_sessions``,
    ``agent.session_idle_timeout_s``) and knows its side calls (``[agent.side_calls]``). Without ``[agent]`` it enforces the run's sampling (its samples train a
    policy at those settings), tolerates unknown fields and keeps the proxy's session defaults."""
    from rollflow.tito.side_calls import SideCallRule

    agent = config.agent
    return {
        "model_name": config.model.path,
        "host": host or (agent.host if agent is not None else "127.0.0.1"),
        "port": port if port is not None else (agent.port if agent is not None else 0),
        "advertise_url": agent.advertise_url if agent is not None else None,
        "admin_token": admin_token,
        "default_max_tokens": config.sampling.max_tokens,
        "default_temperature": config.sampling.temperature,
        "default_top_p": config.sampling.top_p,
        "default_top_k": config.sampling.top_k,
        "enforce_sampling": agent.enforce_sampling if agent is not None else True,
        "strict_requests": agent.strict_requests if agent is not None else False,
        "max_n": config.inference.max_batch_size,
        "return_routed_experts": config.inference.return_routed_experts,
        "max_model_len": config.inference.max_model_len,
        "http_limits": config.inference.http_limits(),
        **(
            {
                "max_sessions": agent.max_sessions,
                "session_idle_timeout_s": agent.session_idle_timeout_s,
                "side_calls": SideCallRule(
                    tuple(agent.side_calls.models), agent.side_calls.header, agent.side_calls.predicate
                ),
            }
            if agent is not None
            else {}
        ),
    }


def build_proxy(
    config: RunConfig,
    client: Any,
    renderer: Any,
    tokenizer: Any,
    *,
    host: str | None = None,
    port: int | None = None,
    admin_token: str | None = None,
) -> TITOProxy:
    """A TITO proxy over ``client`` in this process, with ``proxy_options(config, ...)``. Not started: enter
    it (``async with``)."""
    from rollflow.tito.proxy import TITOProxy

    options = proxy_options(config, host=host, port=port, admin_token=admin_token)
    return TITOProxy(client, renderer, tokenizer, **options)


def build_agent_proxy(
    config: RunConfig, client: Any, renderer: Any, tokenizer: Any
) -> TITOProxy | ProxyWorkers:
    """The proxy of a run's agents: in ``agent.proxy_workers`` worker processes (``ProxyWorkers``), or in
    this process (``build_proxy``) when it is 0. Not started: enter it (``async with``)."""
    workers = config.agent.proxy_workers if config.agent is not None else 0
    if workers == 0:
        return build_proxy(config, client, renderer, tokenizer)
    from rollflow.tito.workers import ProxyWorkers

    return ProxyWorkers(client, renderer, tokenizer, workers=workers, **proxy_options(config))


@contextlib.asynccontextmanager
async def build_agent_generator(
    config: RunConfig, client: Any, renderer: Any, tokenizer: Any
) -> AsyncIterator[AgentGenerator]:
    """An ``AgentGenerator`` for ``config.agent`` over ``client``, with the proxy it owns
    (``build_agent_proxy``: in this process, or in ``agent.proxy_workers`` worker processes), listening for
    as long as the context is open.

    Raises:
        ConfigError: ``config.agent`` is unset, its callable or composer does not resolve, or the traces
            directory (``agent.save_traces``) cannot be written.
    """
    from rollflow.rollout.agent import AgentGenerator, resolve_agent
    from rollflow.tito.composer import resolve_composer
    from rollflow.tito.saved import TRACES_DIR, TraceWriter

    settings = config.agent
    if settings is None:
        raise ConfigError("build_agent_generator needs an [agent] section in the config")
    if settings.max_seq_len is None:
        raise ConfigError("agent.max_seq_len must be set")
    agent = resolve_agent(settings.callable, settings.command, env=settings.env)
    composer = resolve_composer(settings.composer)
    proxy = build_agent_proxy(config, client, renderer, tokenizer)
    writer = None
    if settings.save_traces != "none":
        writer = await anyio.to_thread.run_sync(
            TraceWriter, config.run_dir / TRACES_DIR, settings.save_traces
        )
    async with proxy:
        yield AgentGenerator(
            proxy,
            agent,
            mode=settings.mode,
            composer=composer,
            max_seq_len=settings.max_seq_len,
            timeout_s=settings.timeout_s,
            filter_overlong=settings.filter_overlong,
            seed=config.seed,
            max_concurrent=settings.max_concurrent,
            trace_writer=writer,
        )


@contextlib.asynccontextmanager
async def open_env(config: RunConfig) -> AsyncIterator[Any]:
    """The entered ``EnvSource`` of ``config.env`` (loaded off the event loop); its ``task`` is the run's
    prompts.

    Raises:
        ConfigError: ``config.env`` is unset or the environment does not load.
        MissingExtraError: the environment kind's package is not installed.
    """
    from rollflow.rollout.envs import env_source

    if config.env is None:
        raise ConfigError("open_env needs an [env] section in the config")
    source = await anyio.to_thread.run_sync(env_source, config.env, config.model.path)
    async with source:
        yield source


@contextlib.asynccontextmanager
async def build_env_generator(
    config: RunConfig, client: Any, renderer: Any, tokenizer: Any, source: Any
) -> AsyncIterator[Any]:
    """An ``EnvGenerator`` for ``config.env`` over the entered ``source``, with the TITO proxy it owns
    (``build_proxy``), listening for as long as the context is open."""
    from rollflow.rollout.envs import EnvGenerator

    settings = config.env
    if settings is None or settings.max_seq_len is None:
        raise ConfigError("build_env_generator needs an [env] section with env.max_seq_len")
    async with build_proxy(config, client, renderer, tokenizer) as proxy:
        yield EnvGenerator(
            proxy,
            source,
            max_seq_len=settings.max_seq_len,
            mode=settings.mode,
            timeout_s=settings.timeout_s,
            filter_overlong=settings.filter_overlong,
            seed=config.seed,
            max_concurrent=settings.max_concurrent,
            on_failure=settings.on_failure,
            max_retries=settings.max_retries,
            min_group_samples=settings.min_group_samples,
            max_failure_rate=settings.max_failure_rate,
            failure_window=settings.failure_window,
        )


@contextlib.asynccontextmanager
async def open_generator(
    config: RunConfig,
    client: Any,
    renderer: Any,
    tokenizer: Any,
    task: Any,
    rewarder: Any = None,
) -> AsyncIterator[Any]:
    """The generator a config asks for: ``EnvGenerator`` with ``[env]`` (``task`` is then the entered
    ``EnvSource``'s, see ``open_env``), ``AgentGenerator`` with ``[agent]`` (its proxy listens while the
    context is open), else ``SingleTurnGenerator`` scored by ``rewarder`` (default: ``data.reward`` and
    ``data.rewards`` over ``task``, under ``data.reward_timeout_s``), continuing aborted samples per
    ``orchestrator.partial_rollouts``, with prompts that cannot fit ``inference.max_model_len`` refused or
    skipped per ``data.on_bad_row`` (``PromptLimit``).

    Raises:
        ConfigError: the agent, composer or reward does not resolve.
    """
    if config.env is not None:
        source = getattr(task, "source", None)
        if source is None:
            raise ConfigError("with [env], open_generator needs the task of open_env's source")
        async with build_env_generator(config, client, renderer, tokenizer, source) as generator:
            yield generator
        return
    if config.agent is not None:
        async with build_agent_generator(config, client, renderer, tokenizer) as generator:
            yield generator
        return
    from rollflow.rollout.generator import PromptLimit, SingleTurnGenerator
    from rollflow.rollout.rewards import Rewarder

    if rewarder is None:
        rewarder = Rewarder.from_config(
            config.data.reward, task, config.data.rewards, timeout_s=config.data.reward_timeout_s
        )
    yield SingleTurnGenerator(
        client,
        renderer,
        rewarder,
        config.sampling,
        seed=config.seed,
        partial_rollouts=config.orchestrator.partial_rollouts,
        prompt_limit=PromptLimit.from_config(config, tokenizer, task),
        tokenizer=tokenizer,
    )


async def push_policy(config: RunConfig, client: Any, weights: dict[str, Any], policy_version: int) -> None:
    """Push checkpoint ``weights`` into the engines behind ``client`` by the run's ``weight_sync`` strategy;
    the engines then stamp ``policy_version`` on their tokens."""
    from rollflow.weights import StaticWeights

    barrier = build_barrier(config, client)
    try:
        await barrier.update(StaticWeights(weights.items), policy_version, "wait")
    finally:
        barrier.close()


async def serve_proxy(
    config: RunConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    admin_token: str | None = None,
    ready: Callable[[TITOProxy], None] | None = None,
) -> None:
    """Run a proxy (``build_proxy``) over the inference ``config.inference`` describes until cancelled
    (``rollflow proxy``): engines in this process, servers (and a router) it starts, or external URLs, as a
    run would have them. ``ready``, if given, is called with the running proxy once it listens.

    Raises:
        ModelNotFoundError: ``model.path`` does not resolve.
        ServerStartError: a server or the router did not start.
        OSError: the proxy could not listen.
    """
    from rollflow.inference.setup import get_inference_client

    tokenizer, renderer = await anyio.to_thread.run_sync(load_chat, config)
    async with get_inference_client(config) as client:
        proxy = build_proxy(
            config,
            client,
            renderer,
            tokenizer,
            host=host,
            port=port,
            admin_token=admin_token or secrets.token_urlsafe(24),
        )
        async with proxy:
            if ready is not None:
                ready(proxy)
            await asyncio.Event().wait()
