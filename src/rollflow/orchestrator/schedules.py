"""Schedules: when a prompt may start generating, and how weight updates treat work in flight.

Conventions. Step ``t`` trains the weights of policy version ``t - 1`` and its barrier publishes version ``t``.
A sample's *staleness* at step ``t`` is ``(t - 1) - v``, where ``v`` is the policy version of its oldest token
(the version it started with). ``sync`` is staleness 0 everywhere; ``one_step`` allows 1; ``fully_async``
allows ``max_staleness``.

Admission control: after ``k`` completed steps a prompt may start only while fewer than
``(k + 1 + max_staleness) * prompts_per_step`` prompts have been started (dropped ones give their place
back) and fewer than ``max_inflight`` groups are generating. (Steps, not versions: a step whose update was
skipped publishes no version, but its prompts are trained all the same.) That keeps every admitted prompt trainable within
the bound *if* groups finish in admission order; groups that finish late anyway are caught per sample by
``is_within_bound`` when a batch is collected, dropped, regenerated and counted.
"""

from __future__ import annotations

import time

import anyio

from rollflow.config import OrchestratorConfig
from rollflow.inference.client import PauseMode


class StalenessSchedule:
    """Admission control with a per-sample staleness bound (``sync`` is ``max_staleness = 0``)."""

    def __init__(
        self,
        *,
        prompts_per_step: int,
        max_staleness: int,
        max_inflight: int,
        pause_mode: PauseMode,
        policy_version: int = 0,
        steps_done: int = 0,
    ):
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.max_inflight = max_inflight
        self.pause_mode: PauseMode = pause_mode
        # Runtime state. `started` counts admitted prompts that are trained or still may be; a resumed run
        # starts from the prompts its checkpoint trained.
        self.policy_version = policy_version
        self.steps_done = steps_done
        self.started = steps_done * prompts_per_step
        self.inflight = 0
        self._changed = anyio.Event()
        # Time with no group generating (the generator idle), for the idle-fraction metric.
        self._idle_since: float | None = time.perf_counter()
        self._idle_total = 0.0

    @classmethod
    def from_config(
        cls, config: OrchestratorConfig, *, policy_version: int, steps_done: int
    ) -> StalenessSchedule:
        max_staleness = {"sync": 0, "one_step": 1}.get(config.mode, config.max_staleness)
        # Nothing is in flight at a sync barrier, so its pause has nothing to decide.
        pause_mode: PauseMode = "wait" if config.mode == "sync" else config.barrier
        return cls(
            prompts_per_step=config.prompts_per_step,
            max_staleness=max_staleness,
            max_inflight=config.max_inflight,
            pause_mode=pause_mode,
            policy_version=policy_version,
            steps_done=steps_done,
        )

    @property
    def admission_limit(self) -> int:
        return (self.steps_done + 1 + self.max_staleness) * self.prompts_per_step

    def _may_admit(self) -> bool:
        return self.started < self.admission_limit and self.inflight < self.max_inflight

    async def admit(self) -> None:
        """Wait until one more prompt may start generating, and count it as started and in flight."""
        while not self._may_admit():
            await self._changed.wait()
        self.started += 1
        if self.inflight == 0 and self._idle_since is not None:
            self._idle_total += time.perf_counter() - self._idle_since
            self._idle_since = None
        self.inflight += 1

    def group_finished(self) -> None:
        """A group left generation (scored, failed or cancelled)."""
        self.inflight -= 1
        if self.inflight == 0:
            self._idle_since = time.perf_counter()
        self._notify()

    def group_dropped(self) -> None:
        """A finished group was not trained (too stale): its prompt will be started again."""
        self.started -= 1
        self._notify()

    def published(self, policy_version: int, steps_done: int) -> None:
        """Step ``steps_done`` is complete and the engines hold ``policy_version``."""
        self.policy_version = policy_version
        self.steps_done = steps_done
        self._notify()

    def generator_idle_s(self, now: float | None = None) -> float:
        """Seconds so far (up to ``now``, a ``time.perf_counter()`` reading) with no group generating."""
        idle = self._idle_total
        if self._idle_since is not None:
            idle += (time.perf_counter() if now is None else now) - self._idle_since
        return idle

    def staleness(self, sample_version: int) -> int:
        """Staleness of a sample started at ``sample_version`` if trained now (on the current weights)."""
        return self.policy_version - sample_version

    def is_within_bound(self, sample_version: int) -> bool:
        return self.staleness(sample_version) <= self.max_staleness

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
