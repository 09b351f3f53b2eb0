"""``EnvGenerator``: a prompt's group from an environment, one TITO session per trajectory, where a failure is
never a reward.

Each trajectory runs the environment's ``rollout`` against its own session (``AgentGenerator`` opens,
times and composes it, so samples carry exact tokens, loss masks and per-token versions). A trajectory
fails when the environment raised or lost its server (``env_errors``) or timed out (``env_timeouts``, its
own deadline or ``env.timeout_s``); its samples are masked, never scored 0. With ``env.on_failure =
"refill"`` a failed trajectory runs again, up to ``env.max_retries`` times (``env_retries``). A group left
with fewer than ``env.min_group_samples`` good trajectories is dropped: every sample masked
(``env_group_dropped``), counted (``env_dropped_groups``). Over the last ``env.failure_window`` attempts, a
failed share above ``env.max_failure_rate`` stops the run (``EnvFailureRateError``) rather than letting it
retry silently or train on noise.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from rollflow.errors import ConfigError, EnvError, EnvFailureRateError
from rollflow.messages import RolloutRequest, Sample, ScoredGroup
from rollflow.rollout.agent import AgentGenerator, AgentTask, group_metrics, number_samples
from rollflow.rollout.envs.base import EnvOutcome, EnvSource
from rollflow.rollout.rewards import REWARD_COUNT, REWARD_SUM

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy
    from rollflow.tito.workers import ProxyWorkers

log = structlog.get_logger(__name__)

ENV_ERROR = "env_error"
"""``mask_reason`` of the samples of a trajectory whose environment raised or lost its server."""
ENV_TIMEOUT = "env_timeout"
"""``mask_reason`` of the samples of a trajectory that timed out."""
ENV_GROUP_DROPPED = "env_group_dropped"
"""``mask_reason`` of every sample of a group left with too few good trajectories."""


class FailureRate:
    """The share of failed attempts over the last ``window`` ones; ``record`` raises once it passes
    ``max_rate`` with a full window."""

    def __init__(self, max_rate: float, window: int):
        if not 0 < max_rate <= 1 or window < 1:
            raise ConfigError(
                f"need 0 < max_failure_rate <= 1 and failure_window >= 1, got {max_rate}, {window}"
            )
        self.max_rate = max_rate
        self.window = window
        self._recent: collections.deque[str | None] = collections.deque(maxlen=window)
        self.last_error: str | None = None

    def record(self, cause: str | None, error: str | None = None) -> None:
        """Count one attempt (``cause``: None when it succeeded, else ``error`` or ``timeout``).

        Raises:
            EnvFailureRateError: the window is full and its failed share is above ``max_rate``.
        """
        self._recent.append(cause)
        if error is not None:
            self.last_error = error
        failed = [c for c in self._recent if c is not None]
        if len(self._recent) == self.window and len(failed) > self.max_rate * self.window:
            causes = collections.Counter(failed)
            counts = ", ".join(f"{count} {name}s" for name, count in sorted(causes.items()))
            raise EnvFailureRateError(
                f"the environment failed {len(failed)} of the last {self.window} trajectories ({counts}), "
                f"above env.max_failure_rate = {self.max_rate:g}; last error: {self.last_error or 'a timeout'}. "
                "Fix the environment (or its server), or raise env.max_failure_rate / env.timeout_s"
            )


class EnvGenerator:
    """Generates a prompt's group by running an environment ``num_samples`` times (see the module docstring).

    Args:
        proxy: the running TITO proxy the environment's model client talks to (owned by the caller).
        source: the entered environment (``EnvSource``).
        on_failure, max_retries, min_group_samples, max_failure_rate, failure_window: ``[env]``'s rules.
        The rest: as ``AgentGenerator``'s.
    """

    def __init__(
        self,
        proxy: TITOProxy | ProxyWorkers,
        source: EnvSource,
        *,
        max_seq_len: int,
        mode: str = "per_branch",
        composer: Any = None,
        timeout_s: float = 300.0,
        filter_overlong: bool = False,
        seed: int = 0,
        max_concurrent: int | None = None,
        on_failure: str = "refill",
        max_retries: int = 2,
        min_group_samples: int = 1,
        max_failure_rate: float = 0.5,
        failure_window: int = 64,
    ):
        if on_failure not in ("refill", "mask"):
            raise ConfigError(f"env.on_failure must be 'refill' or 'mask', got {on_failure!r}")
        self.source = source
        self.on_failure = on_failure
        self.max_retries = max_retries if on_failure == "refill" else 0
        self.min_group_samples = min_group_samples
        self.failure_rate = FailureRate(max_failure_rate, failure_window)
        # Outcomes of running trajectories by (prompt, sample): a retry of one runs only after it is taken.
        self._outcomes: dict[tuple[int, int], EnvOutcome] = {}
        self._trajectories = AgentGenerator(
            proxy,
            self._rollout,
            mode=mode,
            composer=composer,
            max_seq_len=max_seq_len,
            timeout_s=timeout_s,
            filter_overlong=filter_overlong,
            seed=seed,
            max_concurrent=max_concurrent,
        )

    async def _rollout(self, base_url: str, task: AgentTask) -> float:
        """The agent ``AgentGenerator`` runs: the environment's rollout; a failed one raises, so that its
        samples are masked."""
        try:
            outcome = await self.source.rollout(base_url, task)
        except Exception as error:  # the environment's own bug or a lost server: the trajectory failed
            outcome = EnvOutcome(error=f"{type(error).__name__}: {error}")
        self._outcomes[(task.prompt_index, task.sample_index)] = outcome
        if outcome.timed_out:
            raise EnvError("the environment timed out")
        if outcome.error is not None:
            raise EnvError(outcome.error)
        return outcome.reward

    async def generate_group(self, request: RolloutRequest) -> ScoredGroup:
        """Run the environment ``request.num_samples`` times concurrently, refilling failed trajectories by
        ``on_failure``. ``metrics``: ``env_trajectories``, ``env_errors``, ``env_timeouts``, ``env_retries``,
        ``env_dropped_groups``, ``reward_sum/NAME`` and ``reward_count/NAME`` of each named reward (the
        orchestrator logs their means as ``reward/NAME``), and the ``agent_*`` counts of the kept attempts.

        Raises:
            EnvFailureRateError: recent attempts failed above ``env.max_failure_rate``.
        """
        started = time.perf_counter()
        num = request.num_samples
        results: list[tuple[list[Sample], dict[str, float], str | None, EnvOutcome | None]] = [
            ([], {}, None, None)
        ] * num
        counts = {"env_trajectories": float(num), "env_errors": 0.0, "env_timeouts": 0.0, "env_retries": 0.0}

        async def run(sample_index: int) -> None:
            attempt = 0
            while True:
                samples, metrics = await self._trajectories.run_trajectory(request, sample_index)
                outcome = self._outcomes.pop((request.prompt_index, sample_index), None)
                cause = _failure_cause(metrics, outcome)
                if cause is not None:
                    counts[f"env_{cause}s"] += 1
                    error = outcome.error if outcome is not None else None
                    log.warning(
                        "environment trajectory failed",
                        prompt_index=request.prompt_index,
                        sample_index=sample_index,
                        attempt=attempt,
                        cause=cause,
                        error=error,
                    )
                self.failure_rate.record(cause, outcome.error if outcome is not None else None)
                if cause is None or attempt >= self.max_retries:
                    break
                attempt += 1
                counts["env_retries"] += 1
            if cause is not None:
                reason = ENV_TIMEOUT if cause == "timeout" else ENV_ERROR
                for sample in samples:
                    _mask(sample, reason)
            results[sample_index] = (samples, metrics, cause, outcome)

        try:
            async with anyio.create_task_group() as tg:
                for sample_index in range(num):
                    tg.start_soon(run, sample_index)
        except BaseExceptionGroup as group:
            # The limit is the run's stop, not one of several task failures: raise it as itself.
            limit = group.subgroup(EnvFailureRateError)
            if limit is None:
                raise
            raise _first(limit) from None
        metrics = group_metrics([metrics for _, metrics, _, _ in results])
        metrics.update(counts)
        good = [outcome for _, _, cause, outcome in results if cause is None]
        dropped = len(good) < self.min_group_samples
        metrics["env_dropped_groups"] = float(dropped)
        if dropped:
            log.warning(
                "environment group dropped",
                prompt_index=request.prompt_index,
                good=len(good),
                min_group_samples=self.min_group_samples,
            )
        for outcome in good if not dropped else []:
            for name, value in (outcome.parts if outcome is not None else {}).items():
                metrics[REWARD_SUM + name] = metrics.get(REWARD_SUM + name, 0.0) + value
                metrics[REWARD_COUNT + name] = metrics.get(REWARD_COUNT + name, 0.0) + 1.0
        samples = number_samples([composed for composed, _, _, _ in results])
        for sample in samples if dropped else []:
            if not sample.masked:
                _mask(sample, ENV_GROUP_DROPPED)
        return ScoredGroup(
            prompt_index=request.prompt_index,
            samples=samples,
            generation_time_s=time.perf_counter() - started,
            metrics=metrics,
        )


def _failure_cause(metrics: dict[str, float], outcome: EnvOutcome | None) -> str | None:
    """``timeout``, ``error`` or None (the trajectory finished) of one attempt."""
    if metrics.get("is_timeout") or (outcome is not None and outcome.timed_out):
        return "timeout"
    if metrics.get("is_error") or (outcome is not None and outcome.error is not None):
        return "error"
    return None


def _first(group: BaseExceptionGroup) -> BaseException:
    error = group.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error


def _mask(sample: Sample, reason: str) -> None:
    sample.masked = True
    sample.mask_reason = reason
    sample.reward = 0.0
