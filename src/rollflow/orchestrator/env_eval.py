"""``[eval]`` with ``[env]``: the environment's held-out tasks, run by ``EnvGenerator``s.

The held-out tasks are a second environment built from ``eval.env_args`` merged over ``env.args`` (its first
``eval.num_prompts`` tasks, e.g. another split), or the training environment's tasks after its
``env.num_tasks`` training ones (OpenEnv: the reset seeds after them, on the same server). Each evaluation
kind (greedy, sampled) gets its own ``EnvGenerator`` behind its own TITO proxy, which enforces that kind's
sampling, so trajectories keep exact tokens and the environment's own reward. Evaluation trajectories are
never retried (each failure is counted once, ``eval/env_errors``, ``eval/env_timeouts``, and is never scored)
and never count toward the run's ``env.max_failure_rate``: that limit guards what is trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from rollflow.config import EvalConfig, RunConfig
from rollflow.config.loading import deep_merge
from rollflow.errors import ConfigError
from rollflow.orchestrator.builders import build_env_generator, open_env

if TYPE_CHECKING:
    from rollflow.rollout.evaluation import Evaluator


@contextlib.asynccontextmanager
async def open_env_evaluator(
    config: RunConfig, client: Any, renderer: Any, tokenizer: Any, source: Any = None
) -> AsyncIterator[Evaluator]:
    """An ``Evaluator`` of ``config.env``'s held-out tasks (see the module docstring); ``source`` is the
    run's entered environment (unset: it is opened here). Its proxies listen while the context is open.

    Raises:
        ConfigError: no ``[env]``, or the held-out tasks do not resolve (``eval.env_args``, ``env.num_tasks``).
        MissingExtraError: the environment kind's package is not installed.
    """
    from rollflow.rollout.evaluation import Evaluator, eval_sampling

    env, evaluation = config.env, config.eval or EvalConfig()
    if env is None:
        raise ConfigError("open_env_evaluator needs an [env] section in the config")
    async with contextlib.AsyncExitStack() as stack:
        if evaluation.env_args is not None:
            held_out = msgspec.structs.replace(
                env, args=deep_merge(env.args, evaluation.env_args), num_tasks=evaluation.num_prompts
            )
            eval_config = msgspec.structs.replace(config, env=held_out)
            task = (await stack.enter_async_context(open_env(eval_config))).task
        else:
            if env.num_tasks is None:
                raise ConfigError("[eval] with [env] needs env.num_tasks or eval.env_args")
            if source is None:
                source = await stack.enter_async_context(open_env(config))
            task = await anyio.to_thread.run_sync(source.held_out, env.num_tasks, evaluation.num_prompts)
        # No retries, no run-stopping limit (1.0 is never passed), no dropped groups: see the docstring.
        rules = msgspec.structs.replace(
            env, on_failure="mask", max_retries=0, min_group_samples=1, max_failure_rate=1.0
        )
        generators: dict[str, tuple[Any, int]] = {}
        for kind, (sampling, samples) in eval_sampling(config, evaluation).items():
            kind_config = msgspec.structs.replace(config, env=rules, sampling=sampling)
            generator = await stack.enter_async_context(
                build_env_generator(kind_config, client, renderer, tokenizer, task.source)
            )
            generators[kind] = (generator, samples)
        yield Evaluator(config, client, renderer, task, tokenizer, generators=generators)
