"""One training step as data: the stages after generation, each one task that reads typed messages from a
bounded channel and writes what it made to the next, and the meter that times their waits.

::

    generation ──ScoredGroup──▶ batcher ──BatchReady──▶ trainer ──StepTrained──▶ barrier
        ▲                          ▲                                               │
        │                          └─BatchWanted── run loop ◀──┐                   │ VersionPublished
        └──── admission: StalenessSchedule.published ──────────┴───────────────────┘

- ``batcher``: on ``BatchWanted`` (the run loop's ask, once the previous step is recorded), receives a
  step's groups and drops (to regenerate) those beyond the staleness bound.
- ``trainer``: packs the batch and takes the optimizer step off the loop (servers asleep around it when
  colocated).
- ``barrier``: pushes the new weights (``WeightBarrier``; woken in two stages when colocated) and counts
  the policy version up.
- ``admission``: the step is complete: the trained prompts are marked, and the schedule admits prompts for
  the next steps. The same message goes on to the run loop, which records the step.

A step's messages pass the stages one after another: the trainer's weights are read by the barrier and the
next batch is checked against the weights it publishes, so a batch is never collected, nor a step taken,
while the previous step is in flight. What overlaps is generation (its own task, outliving ``run`` calls)
with all of this, as far as the schedule admits. ``PipelineMeter`` shows how far: how long each stage waited
on its input and on its output each step, and how full each channel was.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from rollflow.channels import Channel, channel
from rollflow.messages import (
    BatchReady,
    BatchWanted,
    ScoredGroup,
    StepResult,
    StepTrained,
    TrainBatch,
    VersionPublished,
)
from rollflow.metrics import (
    PIPELINE_DEPTH,
    PIPELINE_DEPTH_MAX,
    PIPELINE_WAIT_INPUT,
    PIPELINE_WAIT_OUTPUT,
)
from rollflow.orchestrator.checkpoint import OrchestratorState
from rollflow.orchestrator.colocation import Colocation
from rollflow.orchestrator.schedules import StalenessSchedule

log = structlog.get_logger(__name__)

T = TypeVar("T")


class PipelineMeter:
    """Per step: how long each stage waited on its input and on its output, and each channel's depth.

    A wait is split between the steps it spans (one still going when a step ends counts up to then), so a
    step's figures cover that step's time only. A stage run by several tasks (the generation workers)
    reports its waits per task: the sum of their waits divided by their number, so each stage's figure is
    comparable with the step's time.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, int] = {}
        self._waits: dict[str, float] = {}
        self._channels: dict[str, MemoryObjectReceiveStream[Any]] = {}
        self._max_depth: dict[str, int] = {}
        # Waits going on: token -> (metric, since when it counts for the current step).
        self._open: dict[int, tuple[str, float]] = {}
        self._next_token = 0

    def stage(self, name: str, tasks: int = 1) -> None:
        """Report ``name``'s waits every step (0 when it did not wait), shared by ``tasks`` tasks."""
        self._tasks[name] = tasks
        self._waits.setdefault(PIPELINE_WAIT_INPUT + name, 0.0)
        self._waits.setdefault(PIPELINE_WAIT_OUTPUT + name, 0.0)

    def channel(self, name: str, message_type: type[T], capacity: int) -> Channel[T]:
        """A bounded channel (``rollflow.channels.channel``) whose depth is reported as ``name``."""
        made = channel(message_type, capacity)
        self._channels[name] = made.receive
        self._max_depth[name] = 0
        return made

    def wait_started(self, stage: str, prefix: str) -> int:
        """``stage`` starts waiting (``PIPELINE_WAIT_INPUT`` or ``PIPELINE_WAIT_OUTPUT``); returns the token that ends it."""
        token = self._next_token
        self._next_token += 1
        self._open[token] = (prefix + stage, time.perf_counter())
        return token

    def wait_ended(self, token: int) -> None:
        key, since = self._open.pop(token)
        self._waits[key] = self._waits.get(key, 0.0) + time.perf_counter() - since

    async def receive(self, stage: str, stream: MemoryObjectReceiveStream[T]) -> T:
        """The next message of ``stream``, the wait counted as ``stage``'s input wait. A message already
        waiting is taken without yielding to the loop (where callbacks of work in flight would run first).

        Raises:
            anyio.EndOfStream: every sender is closed and nothing is left.
        """
        try:
            return stream.receive_nowait()
        except anyio.WouldBlock:
            pass
        token = self.wait_started(stage, PIPELINE_WAIT_INPUT)
        try:
            return await stream.receive()
        finally:
            self.wait_ended(token)

    async def send(self, stage: str, name: str, stream: MemoryObjectSendStream[T], message: T) -> None:
        """Send ``message`` on channel ``name``, a wait for room counted as ``stage``'s output wait.

        Raises:
            anyio.BrokenResourceError: the receiving end is closed.
        """
        try:
            stream.send_nowait(message)
        except anyio.WouldBlock:
            token = self.wait_started(stage, PIPELINE_WAIT_OUTPUT)
            try:
                await stream.send(message)
            finally:
                self.wait_ended(token)
        depth = stream.statistics().current_buffer_used
        if depth > self._max_depth.get(name, 0):
            self._max_depth[name] = depth

    def take(self) -> dict[str, float]:
        """The metrics since the last call (a step's), then start counting the next step's."""
        now = time.perf_counter()
        for token, (key, since) in self._open.items():
            self._waits[key] = self._waits.get(key, 0.0) + now - since
            self._open[token] = (key, now)
        metrics: dict[str, float] = {}
        for key, seconds in self._waits.items():
            stage = key.rsplit("/", 1)[1]
            metrics[key] = seconds / self._tasks.get(stage, 1)
        for name, stream in self._channels.items():
            depth = stream.statistics().current_buffer_used
            metrics[PIPELINE_DEPTH + name] = float(depth)
            metrics[PIPELINE_DEPTH_MAX + name] = float(max(self._max_depth[name], depth))
            self._max_depth[name] = depth
        self._waits = dict.fromkeys(self._waits, 0.0)
        return metrics


class StepPipeline:
    """The batcher, trainer, barrier and admission stages of one ``Orchestrator.run`` call, connected by
    bounded channels of one message each. ``start`` runs them in the caller's task group; ``step`` asks for
    one step and returns its ``VersionPublished`` once the step is complete (its prompts marked trained,
    its version admitted)."""

    STAGES = ("batcher", "trainer", "barrier", "admission")

    def __init__(
        self,
        *,
        groups: MemoryObjectReceiveStream[ScoredGroup],
        schedule: StalenessSchedule,
        state: OrchestratorState,
        prompts_per_step: int,
        colocation: Colocation | None,
        train: Callable[[TrainBatch, int], StepResult],
        push: Callable[[int], Awaitable[dict[str, float]]],
        regenerate: Callable[[int], None],
        generation_failure: Callable[[], Awaitable[BaseException]],
        meter: PipelineMeter,
    ):
        """Args:
        groups: the scored groups generation sends (not closed here: it outlives the call).
        train: blocking; packs a batch and trains it on the given policy version (run in a worker thread).
        push: the weight barrier: the trainer's weights reach the engines as the given version.
        regenerate: queue a dropped group's prompt index for generation again.
        generation_failure: the error that ended generation, once the group stream has ended.
        """
        self.groups = groups
        self.schedule = schedule
        self.state = state
        self.prompts_per_step = prompts_per_step
        self.colocation = colocation
        self.train = train
        self.push = push
        self.regenerate = regenerate
        self.generation_failure = generation_failure
        self.meter = meter
        # Runtime state: each channel holds one message, since one step is in flight at a time.
        self.wanted = channel(BatchWanted, 1)
        self.batches = meter.channel("batches", BatchReady, 1)
        self.trained = meter.channel("trained", StepTrained, 1)
        self.published = meter.channel("published", VersionPublished, 1)
        self.admitted = channel(VersionPublished, 1)
        for stage in self.STAGES:
            meter.stage(stage)
        # Train-and-barrier window of the step in flight: (start, generator idle seconds at the start).
        self._window = (0.0, 0.0)

    async def start(self, tg: TaskGroup) -> None:
        """Start the stages in ``tg`` (each ready before the next starts). They run until ``tg`` is
        cancelled: a stage's error cancels it, and so does the run loop once its steps are done (the stages
        then wait for the next ask, holding no message). No stage closes a channel when it ends, so the others
        see the error's cancellation, never an end of stream of their own."""
        for stage in (self._batcher, self._trainer, self._barrier, self._admission):
            await tg.start(stage)

    async def step(self, step: int) -> VersionPublished:
        """Ask for step ``step`` and wait until it is complete (cancelled when a stage fails)."""
        await self.wanted.send.send(BatchWanted(step=step))
        return await self.admitted.receive.receive()

    def close(self) -> None:
        """Close every channel of the stages (not the group stream: generation outlives the call)."""
        for made in (self.wanted, self.batches, self.trained, self.published, self.admitted):
            made.send.close()
            made.receive.close()

    # ---------------------------------------------------------------- the stages

    async def _batcher(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            wanted = await self.wanted.receive.receive()
            ready = await self._collect(wanted.step)
            await self.meter.send("batcher", "batches", self.batches.send, ready)

    async def _collect(self, step: int) -> BatchReady:
        """Receive one step's groups, dropping (and queueing for regeneration) any beyond the staleness bound."""
        started = time.perf_counter()
        groups: list[ScoredGroup] = []
        dropped = 0
        while len(groups) < self.prompts_per_step:
            try:
                group = await self.meter.receive("batcher", self.groups)
            except anyio.EndOfStream:
                raise await self.generation_failure() from None
            # Only trained samples can be stale (masked ones, e.g. a failed agent, may hold no tokens).
            oldest = min((s.min_policy_version for s in group.samples if not s.masked), default=None)
            if oldest is None or self.schedule.is_within_bound(oldest):
                groups.append(group)
                continue
            dropped += 1
            self.regenerate(group.prompt_index)
            self.schedule.group_dropped()
            log.debug("dropped stale group", prompt_index=group.prompt_index, policy_version=oldest)
        groups.sort(key=lambda group: group.prompt_index)
        batch = TrainBatch(step=step, groups=groups)
        return BatchReady(
            batch=batch,
            policy_version=self.state.policy_version,
            collect_time_s=time.perf_counter() - started,
            dropped_stale_groups=dropped,
            staleness=[self.schedule.staleness(s.min_policy_version) for s in batch.samples if not s.masked],
        )

    async def _trainer(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            ready = await self.meter.receive("trainer", self.batches.receive)
            now = time.perf_counter()
            self._window = (now, self.schedule.generator_idle_s(now))
            colocation = self.colocation
            sleep_time = await colocation.sleep() if colocation is not None else 0.0
            try:
                result = await anyio.to_thread.run_sync(self.train, ready.batch, ready.policy_version)
            except BaseException:
                if colocation is not None:
                    await colocation.recover(lambda: self.push(self.state.policy_version))
                raise
            trained = StepTrained(ready=ready, result=result, sleep_time_s=sleep_time)
            await self.meter.send("trainer", "trained", self.trained.send, trained)

    async def _barrier(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            trained = await self.meter.receive("barrier", self.trained.receive)
            barrier = await self._update_weights(trained)
            window_start, idle_at_start = self._window
            now = time.perf_counter()
            window = now - window_start
            idle = self.schedule.generator_idle_s(now) - idle_at_start
            published = VersionPublished(
                trained=trained,
                policy_version=self.state.policy_version,
                barrier=barrier,
                overlap_fraction=max(0.0, 1.0 - idle / window) if window > 0 else 0.0,
            )
            await self.meter.send("barrier", "published", self.published.send, published)

    async def _update_weights(self, trained: StepTrained) -> dict[str, float]:
        """The new weights reach the engines (unless the step made no update), and the version counts up."""
        updated = trained.result.updated
        colocation = self.colocation
        if colocation is not None:
            # Woken in two stages around the push; at sleep level 2 the weights are pushed even when the step
            # made no update (the servers discarded theirs).
            version = self.state.policy_version + int(updated)
            push = (lambda: self.push(version)) if updated or colocation.level == 2 else None
            barrier = {**await colocation.wake(push), "sleep_time_s": trained.sleep_time_s}
        elif updated:
            barrier = await self.push(self.state.policy_version + 1)
        else:
            barrier = {}
        if updated:
            self.state.policy_version += 1
        return barrier

    async def _admission(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            published = await self.meter.receive("admission", self.published.receive)
            batch = published.trained.ready.batch
            self.state.step = batch.step
            self.state.mark_trained(group.prompt_index for group in batch.groups)
            self.schedule.published(published.policy_version, steps_done=batch.step)
            await self.admitted.send.send(published)
