"""Agent rollouts: run user agent code against a TITO proxy session per trajectory, and turn what the model
sampled into a scored group of token-exact samples.

An agent is either

- an async Python callable ``agent(base_url: str, task: AgentTask) -> float`` (``agent.callable``, an import
  path ``package.module:function`` or ``path/to/file.py:function``), which points any OpenAI-compatible
  client at ``base_url`` and returns the trajectory's reward; or
- a command (``agent.command``, an argument list, or a string run by the shell), started once per trajectory
  with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (a dummy; the session URL is the credential) and
  ``OPENAI_MODEL`` in its environment and the task as one JSON object (the ``AgentTask`` fields) on stdin. It
  prints the reward as the last line of stdout and exits 0.

Outcomes: an agent that runs past ``timeout_s`` is cancelled (a command's whole process group is killed) and
its samples are masked as ``"timeout"``; an exception (``SystemExit`` too), a non-zero exit or a reward that is
not a real number finite in float32 (``rewards.reward_value``) masks them as ``"error"``. Either way the group goes on. Every trajectory contributes at least one sample (an
empty masked one when the model was never called), so it is visible in the group and in the counts.

Requests sample at ``sampling.temperature``, ``sampling.top_p`` and ``sampling.top_k``, which the trainer's
PPO ratio assumes: with ``agent.enforce_sampling`` (the default) an agent's own ``temperature``, ``top_p`` or
``top_k`` is overridden and counted (``agent_sampling_overridden``). Where top-k/top-p cut the vocabulary,
the samples carry each sampled token's kept set (``Sample.kept_counts``) for ``trainer.sampling_mask``. Pass
``task.seed`` (plus the turn number) as ``seed`` for reproducible sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from rollflow.errors import AgentError, ConfigError
from rollflow.imports import import_object
from rollflow.messages import FinishReason, RolloutRequest, Sample, ScoredGroup
from rollflow.processes import start_command
from rollflow.rollout.callbacks import is_interruption
from rollflow.rollout.generator import sample_seed
from rollflow.rollout.rewards import reward_value
from rollflow.tito.composer import COMPOSE_MODES, TITOSample, resolve_composer, trace_metrics
from rollflow.tito.saved import TraceWriter, trace_record

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy
    from rollflow.tito.workers import ProxyWorkers

log = structlog.get_logger(__name__)

AgentFn = Callable[[str, "AgentTask"], Awaitable[float]]

# Environment of command agents besides OPENAI_BASE_URL; the key is a dummy the SDKs insist on.
DUMMY_API_KEY = "rollflow"
# A killed command's stderr kept for the error message.
_STDERR_TAIL = 2000


class AgentTask(msgspec.Struct, frozen=True):
    """What an agent gets for one trajectory (as JSON on a command's stdin): the task item (``messages``,
    ``answer``, ``metadata``, as in ``TaskItem``) and where the trajectory sits."""

    messages: list[dict[str, Any]]
    answer: Any = None
    metadata: dict[str, Any] = {}
    prompt_index: int = 0
    sample_index: int = 0
    # Per-trajectory sampling seed (depends on run seed and position only); add the turn number per call.
    seed: int = 0
    # The model name requests must use.
    model: str = ""


class CommandAgent:
    """Runs ``command`` per trajectory (see the module docstring for its protocol).

    Args:
        command: an argument list (executed directly) or a string (run by ``/bin/sh``).
        env: extra environment variables, on top of this process's environment.
        kill_grace_s: after a timeout, how long the process group gets between SIGTERM and SIGKILL.
    """

    def __init__(
        self, command: str | list[str], *, env: dict[str, str] | None = None, kill_grace_s: float = 2.0
    ):
        if not command:
            raise ConfigError("agent.command is empty")
        self.command = command
        self.env = dict(env or {})
        self.kill_grace_s = kill_grace_s

    def __repr__(self) -> str:
        return f"CommandAgent({self.command!r})"

    async def __call__(self, base_url: str, task: AgentTask) -> float:
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": DUMMY_API_KEY,
            "OPENAI_MODEL": task.model,
        }
        # Its own process group, so a timeout kills whatever the command started too; it dies with this
        # process. A string runs in the shell (`/bin/sh -c`), as it did from asyncio's shell subprocess.
        argv = ["/bin/sh", "-c", self.command] if isinstance(self.command, str) else self.command
        child = await start_command(
            argv,
            name="agent",
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await child.process.communicate(msgspec.json.encode(task))
        except BaseException:
            await child.stop(self.kill_grace_s)  # shielded from the cancellation it may be part of
            raise
        process = child.process
        err = stderr.decode(errors="replace")[-_STDERR_TAIL:].strip()
        if process.returncode != 0:
            raise AgentError(f"command exited with status {process.returncode}; stderr: {err or '(empty)'}")
        lines = stdout.decode(errors="replace").strip().splitlines()
        last = lines[-1].strip() if lines else ""
        try:
            return float(last)
        except ValueError:
            raise AgentError(
                f"the last line of stdout must be the reward as a number, got {last[:200]!r}"
            ) from None


def resolve_agent(
    function: str | AgentFn | None = None,
    command: str | list[str] | None = None,
    *,
    env: dict[str, str] | None = None,
) -> AgentFn:
    """The agent to run: an async ``function`` (or its import path), or a ``CommandAgent`` for ``command``.

    Raises:
        ConfigError: both or neither given, the import path does not resolve, or the callable is not async.
    """
    if (function is None) == (command is None):
        raise ConfigError("give exactly one of agent.callable and agent.command")
    if command is not None:
        return CommandAgent(command, env=env)
    agent = import_object(function, key="agent.callable") if isinstance(function, str) else function
    call = getattr(agent, "__call__", None)  # noqa: B004 - async callable objects
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(call)):
        raise ConfigError(
            f"agent.callable = {function!r} must be an async function `async def agent(base_url, task) -> float` "
            "(a timeout has to be able to cancel it)"
        )
    return agent


def _reward(value: Any) -> float:
    """The agent's reward, held to the contract of every reward (``rewards.reward_value``).

    Raises:
        AgentError: the value is not a real number finite in float32.
    """
    try:
        return reward_value(value)
    except ValueError as problem:
        raise AgentError(f"the agent {problem}") from None


class AgentGenerator:
    """Generates a prompt's group by running the agent ``num_samples`` times, each in its own TITO session.

    Args:
        proxy: the running proxy the agent talks to, in this process or in workers (owned by the caller; see
            ``rollflow.orchestrator.builders.build_agent_generator``).
        agent: an async callable ``agent(base_url, task) -> reward``, e.g. from ``resolve_agent``.
        mode: the composer mode (``per_branch``, ``single_branch``, ``step_wise``).
        composer: a composer called like ``rollflow.tito.compose`` (default), or its import path.
        max_seq_len: longest sample in tokens (see ``compose`` for how longer ones are cut or masked).
        timeout_s: longest one trajectory may run.
        filter_overlong: mask overlong samples instead of cutting them.
        seed: the run seed; each trajectory's ``task.seed`` derives from it and its position.
        max_concurrent: most trajectories running at once over all groups (None: no limit).
        trace_writer: keeps the trajectories it wants with the run (``agent.save_traces``); a write that
            fails is logged and counted (``agent_trace_write_errors``), never fatal.
    """

    def __init__(
        self,
        proxy: TITOProxy | ProxyWorkers,
        agent: AgentFn,
        *,
        mode: str = "per_branch",
        composer: str | Callable[..., list[Sample]] | None = None,
        max_seq_len: int,
        timeout_s: float = 300.0,
        filter_overlong: bool = False,
        seed: int = 0,
        max_concurrent: int | None = None,
        trace_writer: TraceWriter | None = None,
    ):
        if mode not in COMPOSE_MODES:
            raise ConfigError(f"agent.mode must be one of {', '.join(COMPOSE_MODES)}, got {mode!r}")
        if max_seq_len < 1 or timeout_s <= 0:
            raise ConfigError(f"need max_seq_len >= 1 and timeout_s > 0, got {max_seq_len} and {timeout_s}")
        self.proxy = proxy
        self.agent = agent
        self.composer = resolve_composer(composer)
        self.mode = mode
        self.max_seq_len = max_seq_len
        self.timeout_s = timeout_s
        self.filter_overlong = filter_overlong
        self.seed = seed
        self._limiter = anyio.CapacityLimiter(max_concurrent) if max_concurrent else None
        self.trace_writer = trace_writer

    async def generate_group(self, request: RolloutRequest) -> ScoredGroup:
        """Run the agent ``request.num_samples`` times concurrently; every sample of a trajectory carries its
        reward. ``metrics`` holds counts summed over the trajectories (see ``group_metrics``)."""
        started = time.perf_counter()
        results: list[tuple[list[Sample], dict[str, float]]] = [([], {})] * request.num_samples

        records: list[dict[str, Any]] = []

        async def run(sample_index: int) -> None:
            results[sample_index] = await self.run_trajectory(request, sample_index, records=records)

        async with anyio.create_task_group() as tg:
            for sample_index in range(request.num_samples):
                tg.start_soon(run, sample_index)
        metrics = group_metrics([metrics for _, metrics in results])
        if self.trace_writer is not None and records:
            records.sort(key=lambda record: record["sample_index"])
            try:
                await anyio.to_thread.run_sync(self.trace_writer.write_group, request.prompt_index, records)
            except OSError as error:  # the samples are unaffected; the trace is lost, and counted
                log.warning(
                    "writing agent traces failed", prompt_index=request.prompt_index, error=str(error)
                )
                metrics["agent_trace_write_errors"] = float(len(records))
        return ScoredGroup(
            prompt_index=request.prompt_index,
            samples=number_samples([composed for composed, _ in results]),
            generation_time_s=time.perf_counter() - started,
            metrics=metrics,
        )

    async def run_trajectory(
        self, request: RolloutRequest, sample_index: int, *, records: list[dict[str, Any]] | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """One agent run in its own session: its composed samples and ``trace_metrics``. With ``records``
        and a ``trace_writer`` that wants this trajectory, its trace record is appended there."""
        async with contextlib.AsyncExitStack() as stack:
            if self._limiter is not None:
                await stack.enter_async_context(self._limiter)
            # The session id goes to the router with every call (prefix-cache affinity) and into logs.
            session_id = f"p{request.prompt_index}-s{sample_index}-{secrets.token_hex(4)}"
            session = await self.proxy.open_session(session_id)
            # Copies: an agent that edits its task in place must not change its siblings' tasks.
            task = AgentTask(
                messages=copy.deepcopy(request.messages),
                answer=copy.deepcopy(request.answer),
                metadata=copy.deepcopy(request.metadata),
                prompt_index=request.prompt_index,
                sample_index=sample_index,
                seed=sample_seed(self.seed, request.prompt_index, sample_index),
                model=self.proxy.model_name,
            )
            try:
                reward, error, timed_out = await self._run_agent(session.base_url, task)
            except BaseException:  # cancelled from outside: free the session, record nothing
                with anyio.CancelScope(shield=True):
                    await self.proxy.close_session(session, error="cancelled", drain_timeout_s=0)
                raise
            failed = error is not None or timed_out
            if failed:
                log.warning("agent trajectory masked", session=session_id, timed_out=timed_out, error=error)
            # A failed agent's requests still in flight are orphans: cancel them rather than wait.
            trace = await self.proxy.close_session(
                session, error=error, timed_out=timed_out, drain_timeout_s=0 if failed else None
            )
        try:
            samples = self.composer(
                trace,
                reward=reward,
                mode=self.mode,
                max_seq_len=self.max_seq_len,
                filter_overlong=self.filter_overlong,
                prompt_index=request.prompt_index,
            )
        except Exception as compose_error:  # one bad trajectory must not end the run; it is counted
            log.exception("composing a trajectory failed; masked", session=session_id)
            trace.error = f"compose failed: {type(compose_error).__name__}: {compose_error}"
            samples = []
        if not samples:
            reason = "timeout" if trace.timed_out else "error" if trace.error or trace.errors else "empty"
            samples = [_empty_sample(request.prompt_index, reason)]
        if records is not None and self.trace_writer is not None and self.trace_writer.wants(sample_index):
            records.append(
                trace_record(
                    trace,
                    reward=reward,
                    prompt_index=request.prompt_index,
                    sample_index=sample_index,
                    mask_reason=next((s.mask_reason for s in samples if s.masked), None),
                    model=self.proxy.model_name,
                )
            )
        return samples, trace_metrics(trace, samples)

    async def _run_agent(self, base_url: str, task: AgentTask) -> tuple[float, str | None, bool]:
        """(reward, error, timed_out) of one agent run."""
        reward, error = 0.0, None
        with anyio.move_on_after(self.timeout_s) as scope:
            try:
                reward = _reward(await self.agent(base_url, task))
            except BaseException as failure:  # any agent failure masks the trajectory (SystemExit too)
                if is_interruption(failure):
                    raise
                error = f"{type(failure).__name__}: {failure}"
        # A deadline that fired is a timeout, even if the agent swallowed the cancellation.
        if scope.cancel_called:
            return 0.0, None, True
        return reward, error, False


def _empty_sample(prompt_index: int, reason: str) -> TITOSample:
    return TITOSample(
        prompt_index=prompt_index,
        sample_index=0,
        prompt_token_ids=[],
        completion_token_ids=[],
        logprobs=[],
        policy_versions=[],
        finish_reason=FinishReason.ABORT,
        loss_mask=[],
        masked=True,
        mask_reason=reason,
    )


def number_samples(trajectories: list[list[Sample]]) -> list[Sample]:
    """The samples of a group's trajectories in one list, each labelled with its trajectory's index and its
    own place in the group (a trajectory composes into one sample per branch)."""
    samples = [sample for composed in trajectories for sample in composed]
    for trajectory, composed in enumerate(trajectories):
        for sample in composed:
            sample.trajectory = trajectory
    for index, sample in enumerate(samples):
        sample.sample_index = index
    return samples


def group_metrics(per_trajectory: list[dict[str, float]]) -> dict[str, float]:
    """A group's counts, summed over its trajectories' ``trace_metrics``: ``agent_trajectories``,
    ``agent_turns``, ``agent_branches``, ``agent_bridged_turns``, ``agent_full_render_turns``,
    ``agent_forked_turns``, ``agent_replayed_requests``, ``agent_context_exceeded``,
    ``agent_sampling_overridden``, ``agent_streams_diverged``, ``agent_unknown_fields``,
    ``agent_ignored_values``, ``agent_side_calls`` (and ``agent_side_calls_<kind>``), ``agent_errors``,
    ``agent_timeouts``,
    ``agent_masked_samples``, ``agent_overlong_samples``. All are counts, so a step's value is the sum over
    its groups."""
    totals: dict[str, float] = {"agent_trajectories": float(len(per_trajectory))}
    for metrics in per_trajectory:
        for key, value in metrics.items():
            name = "agent_" + key.removeprefix("num_").removeprefix("is_")
            name = {"agent_error": "agent_errors", "agent_timeout": "agent_timeouts"}.get(name, name)
            totals[name] = totals.get(name, 0.0) + value
    return totals
