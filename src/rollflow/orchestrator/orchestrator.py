"""The rollout orchestrator: wires the components of a run and drives them from one event loop.

Each component has one job and never references the orchestrator:
- Task / data source: turns a data position into ``RolloutRequest``s (one per prompt); a built-in or custom
  task, or a dataset (``rollout/datasets.py``: data position = epoch and place in that epoch's shuffle).
- ``Evaluator`` (``[eval]``, ``rollout/evaluation.py``): held-out prompts before training and between steps.
- ``SingleTurnGenerator``: samples a group of completions for one request and scores it (``ScoredGroup``).
- Trainer handle (``rollflow.train.handle``): one optimizer step per batch the packer
  (``packing.py``) made of the step's groups; a ``Trainer`` in a worker thread, a ``TrainerProcess`` of its
  own (``trainer.placement``), or ``trainer.num_workers`` data-parallel ``TrainerWorkers`` (local processes
  or Ray actors: the launcher, ``rollflow.launch``, decides where by ``cluster.backend``).
- ``WeightBarrier``: pause engines ▸ the trainer pushes its weights ▸ policy version += 1 ▸ resume.
- ``StalenessSchedule``: when prompts may start (``sync``, ``one_step``, ``fully_async``) and how the barrier
  pauses.
- ``Colocation`` (``inference.colocate``): the servers sleep during each training step and wake in two stages
  around the weight push (``colocation.py``).

The orchestrator builds them in ``setup()`` (``setup.py``), where it also starts the engines on the trainer's
weights as policy version 0. ``run()`` drives them: a data-source task and generation workers in one anyio task
group (in a task of its own, which outlives a ``run()`` call), connected by bounded typed channels; and the
step stages (``pipeline.py``: batcher ▸ trainer ▸ weight barrier ▸ admission, typed messages over bounded
channels) in a task group of the call, whose run loop asks for each step and writes its metrics, evaluation
and checkpoint. Every step's metrics say how long each stage waited and how full each channel was.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from rollflow.channels import Channel
from rollflow.config import RunConfig
from rollflow.errors import (
    NothingToTrainError,
    RollflowError,
)
from rollflow.messages import FinishReason, RolloutRequest, ScoredGroup, StepResult, TrainBatch
from rollflow.metrics import PIPELINE_OVERLAP, PIPELINE_WAIT_INPUT, JsonlWriter, MetricsSink
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.orchestrator.checkpoint import (
    OrchestratorState,
    save_checkpoint,
)
from rollflow.orchestrator.colocation import Colocation
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.orchestrator.pipeline import PipelineMeter, StepPipeline
from rollflow.orchestrator.run_dir import (
    RunLock,
)
from rollflow.orchestrator.schedules import StalenessSchedule
from rollflow.orchestrator.setup import METRICS_FILE as METRICS_FILE
from rollflow.orchestrator.setup import ROLLOUTS_FILE as ROLLOUTS_FILE
from rollflow.orchestrator.setup import OrchestratorSetup
from rollflow.orchestrator.setup import default_log_level as default_log_level
from rollflow.rollout.generator import PROMPT_TOO_LONG, SingleTurnGenerator
from rollflow.rollout.rewards import REWARD_ERROR, REWARD_TIMEOUT, reward_part_means
from rollflow.rollout.tasks import Task, item_caller
from rollflow.train.drift_watch import MismatchWatch
from rollflow.train.handle import TrainerHandle

log = structlog.get_logger(__name__)


class Orchestrator(OrchestratorSetup):
    """Runs RL training for one ``RunConfig``.

    Embedded use, inside any running event loop::

        orch = await Orchestrator.start(config)
        await orch.run(steps=10)
        await orch.stop()

    or ``async with Orchestrator(config) as orch: await orch.run()``.

    From ``setup`` to ``stop`` it holds the run directory's lock (``run_dir.RunLock``): a second orchestrator
    or ``rollflow run`` on the same directory is refused while this one is live.
    """

    # Swappable components, built in setup().
    task: Task
    generator: SingleTurnGenerator
    schedule: StalenessSchedule
    barrier: WeightBarrier
    # Fixed components.
    client: Any  # InferenceClient: in-process engines, or servers behind a router
    trainer: TrainerHandle  # a Trainer, a TrainerProcess (trainer.placement) or TrainerWorkers (num_workers)
    launcher: (
        Any  # rollflow.launch.launcher.Launcher: where trainer workers and servers run (cluster.backend)
    )

    def __init__(
        self,
        config: RunConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        force: bool = False,
        sinks: list[MetricsSink] | None = None,
        inference_client: Any = None,
    ):
        """Args:
        config: the run config.
        resume: continue the run in ``config.run_dir`` from its last checkpoint (from step 0 when it was
            stopped before its first one).
        overwrite: start afresh even when ``config.run_dir`` holds a run: its checkpoints, metrics and
            recorded configs are deleted first (a notebook cell run again). Not with ``resume``.
        force: resume even when ``config`` changes what the run means (``run_dir.MEANING_KEYS``: model,
            task and data, samples per prompt, seeds).

        Raises:
            ValueError: both ``resume`` and ``overwrite``.
        sinks: extra metric sinks (each gets every step's metrics).
        inference_client: an ``InferenceClient`` to use instead of building one from ``config.inference``;
            the caller keeps ownership (it is not closed by ``stop``).
        """
        if resume and overwrite:
            raise ValueError(
                "Orchestrator: resume=True continues the run, overwrite=True deletes it; pass one"
            )
        self.config = config
        self._given_client = inference_client
        self.resume = resume
        self.overwrite = overwrite
        self.force = force
        self.run_dir = config.run_dir
        # Held from setup to stop: one live run per run directory.
        self._lock = RunLock(self.run_dir)
        # Runtime state.
        self.state = OrchestratorState()
        self.history: list[dict[str, Any]] = []
        self._extra_sinks = list(sinks or [])
        self._sinks: list[MetricsSink] = []
        self._rollouts: JsonlWriter | None = None
        self._started_at = 0.0
        self._is_set_up = False
        self._exit_stack = contextlib.AsyncExitStack()
        # Generation (see run): the task feeding and generating groups, and the stream of its results.
        self._generation: asyncio.Task[None] | None = None
        self._results: MemoryObjectReceiveStream[ScoredGroup] | None = None
        self._running = False
        # Held-out evaluation ([eval]): built in setup; its results, also written to the metric sinks.
        self.evaluator: Any = None
        self.eval_history: list[dict[str, Any]] = []
        self.colocation: Colocation | None = None
        # Steps in a row with every sample masked, and their mask reasons (orchestrator.max_masked_steps).
        self._masked_steps = 0
        self._mismatch_watch = MismatchWatch(
            config.trainer.mismatch_kl_threshold, config.trainer.mismatch_kl_steps
        )
        # Prompt indices the feeder may send: the run's steps (as set up: data.epochs may set them) x prompts
        # per step, or more for a run() past them; set by run().
        self._prompt_limit = 0
        self._prompts_changed: anyio.Event | None = None  # set while the feeder runs
        self._masked_reasons: Counter[str] = Counter()
        # Each stage's waits and each channel's depth, reported with every step.
        self._meter = PipelineMeter()

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    async def start(
        cls,
        config: RunConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        force: bool = False,
        sinks: list[MetricsSink] | None = None,
        inference_client: Any = None,
    ) -> Orchestrator:
        """Build every component (load models, start engines) and return the ready orchestrator.

        Raises:
            RunDirectoryInUseError: another live run holds the run directory's lock.
            ConfigError: the run directory already holds a run and neither ``resume`` nor ``overwrite`` is
                set (see ``__init__``), a resume changes
                what the run means and ``force`` is false, or a config value cannot be used (unknown task,
                renderer, reward).
            CheckpointError: ``resume`` is true but no run was started in the run directory.
            ModelNotFoundError: ``model.path`` does not resolve to a local model.
        """
        orchestrator = cls(
            config,
            resume=resume,
            overwrite=overwrite,
            force=force,
            sinks=sinks,
            inference_client=inference_client,
        )
        await orchestrator.setup()
        return orchestrator

    async def __aenter__(self) -> Orchestrator:
        await self.setup()
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        await self.stop(exc)

    async def stop(self, error: BaseException | None = None) -> None:
        """Shut the engines (and any servers and router this run started) down and close the metric files.
        Idempotent. ``error``: what ended the run, if it failed; a server or router this run started that
        had died by then turns it into ``ServerDiedError`` naming the dead process."""
        if not self._is_set_up:
            return
        self._is_set_up = False
        with anyio.CancelScope(shield=True):
            await self._stop_generation()
            for sink in self._sinks:
                # wandb and MLflow sinks flush to their stores (and wandb stops its service) on close.
                await anyio.to_thread.run_sync(sink.close)
            if self._rollouts is not None:
                self._rollouts.close()
            # Releases the run directory's lock last.
            if error is None:
                await self._exit_stack.aclose()
            else:
                await self._exit_stack.__aexit__(type(error), error, error.__traceback__)

    # ---------------------------------------------------------------- the run

    async def run(
        self, steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train for ``steps`` more steps (default: until ``orchestrator.steps`` in total).

        Returns the metrics of the steps run by this call. A checkpoint is written every
        ``checkpoint.every`` steps and after the last step. Generation outlives the call: groups started for
        later steps go on generating after it returns, and the next call trains them (each sample checked
        against the staleness bound when its batch is collected), so ``run(steps=1)`` in a loop overlaps
        like one long call. It stops once ``orchestrator.steps`` are done, when a call fails, and in
        ``stop``; groups it leaves unfinished are generated again later: nothing is trained twice or lost.

        Raises:
            RuntimeError: before ``setup``, or while another ``run`` call of this orchestrator is running.
            Exception: what generation or a training step raised (generation is stopped first).
        """
        if not self._is_set_up:
            raise RuntimeError("Orchestrator.run() before setup(): use `await Orchestrator.start(config)`")
        if self._running:
            raise RuntimeError("Orchestrator.run() is already running: await the first call before the next")
        target = self.config.orchestrator.steps if steps is None else self.state.step + steps
        if target <= self.state.step:
            return []
        self._raise_prompt_limit(target)
        self._running = True
        self._started_at = time.perf_counter()
        run_metrics = []
        try:
            with structlog.contextvars.bound_contextvars(run=self.config.name):
                if self.evaluator is not None and self.state.step == 0 and self._results is None:
                    # Before training, while no training request is in flight.
                    record = {"step": 0, **await self._evaluate()}
                    for sink in self._sinks:
                        sink.log(record)
                results = self._start_generation() if self._results is None else self._results
                await self._run_steps(self._pipeline(results), target, run_metrics, on_step)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_generation()
            raise
        finally:
            self._running = False
        if self.state.step >= self.config.orchestrator.steps:
            await self._stop_generation()  # the configured run is done: nothing left to generate for
        return run_metrics

    async def _run_steps(
        self,
        pipeline: StepPipeline,
        target: int,
        run_metrics: list[dict[str, Any]],
        on_step: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        """The run loop: the step stages in a task group of this call, and one step asked of them at a time,
        recorded (metrics, evaluation, checkpoint) before the next is asked for. A stage's error is raised
        as itself (as the step would have raised it), not inside this task group's exception group."""
        try:
            async with anyio.create_task_group() as tg:
                await pipeline.start(tg)
                while self.state.step < target:
                    metrics = await self._train_step(pipeline)
                    run_metrics.append(metrics)
                    if on_step is not None:
                        on_step(metrics)
                tg.cancel_scope.cancel()  # the stages wait for the next step's ask
        except BaseExceptionGroup as group:
            if len(group.exceptions) != 1:
                raise
            error = group.exceptions[0]
            raise error from error.__cause__
        finally:
            pipeline.close()

    def _pipeline(self, results: MemoryObjectReceiveStream[ScoredGroup]) -> StepPipeline:
        return StepPipeline(
            groups=results,
            schedule=self.schedule,
            state=self.state,
            prompts_per_step=self.config.orchestrator.prompts_per_step,
            colocation=self.colocation,
            # Looked up at each call, so that a test can wrap them on the instance.
            train=lambda batch, policy_version: self._pack_and_train(batch, policy_version),
            push=lambda policy_version: self._push(policy_version),
            regenerate=self._regenerate,
            generation_failure=self._generation_failure,
            meter=self._meter,
        )

    def _start_generation(self) -> MemoryObjectReceiveStream[ScoredGroup]:
        """Start the prompt feeder and ``max_inflight`` generation workers in a task of their own (it outlives
        ``run`` calls; ``_stop_generation`` ends it); returns the stream of their scored groups."""
        self.schedule = StalenessSchedule.from_config(
            self.config.orchestrator,
            policy_version=self.state.policy_version,
            steps_done=self.state.step,
        )
        self._retry_prompts: deque[int] = deque()
        self._next_fresh: int | None = None  # drawn from the untrained indices, not yet sent
        self._prompts_changed = anyio.Event()
        capacity = self.config.orchestrator.max_inflight
        requests = self._meter.channel("prompts", RolloutRequest, capacity)
        results = self._meter.channel("groups", ScoredGroup, capacity)
        self._meter.stage("prompts")
        self._meter.stage("generation", tasks=capacity)
        self._results = results.receive
        # A plain asyncio task, not a task group of run()'s: a task group must be left by the task that
        # entered it, and in a notebook each run() call (and stop()) may come from another task.
        self._generation = asyncio.get_running_loop().create_task(self._generate(requests, results))
        return results.receive

    async def _generate(self, requests: Channel[RolloutRequest], results: Channel[ScoredGroup]) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self._feed_prompts, requests.send)
            # The workers hold the only senders: when they all end (an error, or cancellation), the
            # trainer's receive ends too instead of waiting for ever.
            async with requests.receive, results.send:
                for _ in range(self.config.orchestrator.max_inflight):
                    tg.start_soon(self._generation_worker, requests.receive.clone(), results.send.clone())

    async def _stop_generation(self) -> None:
        """Cancel generation and wait for it to end; its unfinished groups are regenerated by the next run."""
        task, self._generation = self._generation, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: an error that ended it was raised by run() already, or is moot
        if self._results is not None:
            self._results.close()
            self._results = None

    async def _generation_failure(self) -> BaseException:
        """The error that ended generation (its results stream ended while the trainer waited for it); out
        of the task groups' exception groups when it is one rollflow error (or several of one kind), so that
        a prompt too long or a stuck reward reaches the caller as its own clear error."""
        task = self._generation
        if task is None:
            return RuntimeError("generation was stopped while a step waited for its groups")
        await asyncio.wait({task})
        if task.cancelled():
            return RuntimeError("generation was cancelled while a step waited for its groups")
        error = task.exception()
        if error is None:
            return RuntimeError("generation ended while a step waited for its groups")
        return _single_error(error)

    async def _next_prompt_index(self, fresh: Iterator[int]) -> int:
        """A dropped prompt first (it must still be trained), else the next prompt not trained yet, if the run
        trains it: indices stop at ``_prompt_limit`` (steps x prompts per step). Generation runs ahead of
        training, and groups finish out of order, so a prompt past the run's end could otherwise finish first
        and be trained in place of one before it (with ``data.epochs``, a row of an epoch past the last)."""
        while True:
            if self._retry_prompts:
                return self._retry_prompts.popleft()
            if self._next_fresh is None:
                self._next_fresh = next(fresh)
            if self._next_fresh < self._prompt_limit:
                index, self._next_fresh = self._next_fresh, None
                return index
            assert self._prompts_changed is not None  # the feeder runs
            await self._prompts_changed.wait()  # a dropped prompt to retry, or a longer run

    def _regenerate(self, prompt_index: int) -> None:
        """A dropped group's prompt goes back to the feeder (it must still be trained)."""
        self._retry_prompts.append(prompt_index)
        self._prompts_available()

    def _prompts_available(self) -> None:
        """Wake the feeder: a prompt was queued for retry, or the prompt limit grew."""
        if self._prompts_changed is not None:
            self._prompts_changed.set()
            self._prompts_changed = anyio.Event()

    def _raise_prompt_limit(self, target_step: int) -> None:
        limit = max(self.config.orchestrator.steps, target_step) * self.config.orchestrator.prompts_per_step
        if limit > self._prompt_limit:
            self._prompt_limit = limit
            self._prompts_available()

    def _untrained_indices(self) -> Iterator[int]:
        trained_ahead = set(self.state.trained_ahead)
        index = self.state.data_position
        while True:
            if index not in trained_ahead:
                yield index
            index += 1

    async def _feed_prompts(
        self, send: MemoryObjectSendStream[RolloutRequest], *, task_status: TaskStatus[None]
    ) -> None:
        """Data source: emit prompts from the data position on, as the schedule admits them."""
        fresh = self._untrained_indices()
        # A custom task's item() is user code: timed, in a worker thread (data.task_timeout_s).
        item_of = item_caller(self.task, self.config.data.task_timeout_s)
        meter = self._meter
        async with send:
            task_status.started()
            while True:
                # The feeder's input: a prompt to start, and the schedule's admission of it.
                waiting = meter.wait_started("prompts", PIPELINE_WAIT_INPUT)
                try:
                    index = await self._next_prompt_index(fresh)
                    await self.schedule.admit()
                finally:
                    meter.wait_ended(waiting)
                item = await item_of(index)
                request = RolloutRequest(
                    prompt_index=index,
                    messages=item.messages,
                    answer=item.answer,
                    metadata=item.metadata,
                    num_samples=self.config.sampling.samples_per_prompt,
                )
                await meter.send("prompts", "prompts", send, request)

    async def _generation_worker(
        self,
        requests: MemoryObjectReceiveStream[RolloutRequest],
        results: MemoryObjectSendStream[ScoredGroup],
    ) -> None:
        meter = self._meter
        async with requests, results:
            while True:
                try:
                    request = await meter.receive("generation", requests)
                except anyio.EndOfStream:
                    return
                try:
                    group = await self.generator.generate_group(request)
                finally:
                    self.schedule.group_finished()
                await meter.send("generation", "groups", results, group)

    async def _train_step(self, pipeline: StepPipeline) -> dict[str, Any]:
        """One step through the stages (``pipeline.py``), then its metrics, evaluation and checkpoint."""
        step_started = time.perf_counter()
        idle_before = self.schedule.generator_idle_s()
        published = await pipeline.step(self.state.step + 1)
        ready, result = published.trained.ready, published.trained.result
        batch, wait_time = ready.batch, ready.collect_time_s

        step_time = time.perf_counter() - step_started
        metrics = self._step_metrics(batch, result, wait_time, step_time, published.barrier)
        metrics.update(
            _staleness_metrics(ready.staleness),
            dropped_stale_groups=ready.dropped_stale_groups,
            trainer_idle_fraction=wait_time / step_time,
            generator_idle_fraction=(self.schedule.generator_idle_s() - idle_before) / step_time,
            **self._meter.take(),
        )
        metrics[PIPELINE_OVERLAP] = published.overlap_fraction
        if self._eval_due():
            metrics.update(await self._evaluate())
        self._record(batch, metrics)
        self._check_masked(batch)
        if self._checkpoint_due():
            await self._save_checkpoint()
        return metrics

    def _check_masked(self, batch: TrainBatch) -> None:
        """Count steps in a row whose every sample was masked; at ``orchestrator.max_masked_steps`` of them
        the run trains nothing, and stops.

        Raises:
            NothingToTrainError: the message counts the mask reasons and names the last reward problem.
        """
        samples = batch.samples
        if not samples or not all(sample.masked for sample in samples):
            self._masked_steps, self._masked_reasons = 0, Counter()
            return
        self._masked_steps += 1
        self._masked_reasons.update(sample.mask_reason or "masked" for sample in samples)
        limit = self.config.orchestrator.max_masked_steps
        if limit == 0 or self._masked_steps < limit:
            return
        reasons = ", ".join(f"{reason} x{count}" for reason, count in self._masked_reasons.most_common())
        first = batch.step - self._masked_steps + 1
        steps = f"step {first}" if first == batch.step else f"steps {first}-{batch.step}"
        rewarder = getattr(self.generator, "rewarder", None)
        problem = getattr(rewarder, "last_problem", None)
        last = f"; the last reward problem: {problem}" if problem else ""
        raise NothingToTrainError(
            f"{steps}: every sample was masked ({reasons}){last}. The run trains nothing: fix what masks the "
            "samples (the 'sample masked' and 'skipped' warnings in the log name each one), or set "
            "orchestrator.max_masked_steps = 0 to go on regardless"
        )

    async def _push(self, policy_version: int) -> dict[str, float]:
        """The weight-update barrier: the trainer's weights reach the engines as ``policy_version``."""
        return await self.barrier.update(self.trainer, policy_version, self.schedule.pause_mode)

    def _pack_and_train(self, batch: TrainBatch, policy_version: int) -> StepResult:
        """Blocking: advantages per group and the split across the trainer's ranks, then the step."""
        packed = pack_for_trainer(batch, self.config.trainer, self.trainer.world_size)
        return self.trainer.train_step(packed, policy_version=policy_version)

    def _step_metrics(
        self,
        batch: TrainBatch,
        result: StepResult,
        generation_time: float,
        step_time: float,
        barrier: dict[str, float],
    ) -> dict[str, Any]:
        samples = batch.samples
        rewards = [sample.reward for sample in samples if not sample.masked]
        tokens = sum(len(sample.completion_token_ids) for sample in samples)
        finish = Counter(sample.finish_reason for sample in samples)
        metrics: dict[str, Any] = {
            "step": batch.step,
            "policy_version": self.state.policy_version,
            "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "reward_errors": sum(sample.mask_reason == REWARD_ERROR for sample in samples),
            "reward_timeouts": sum(sample.mask_reason == REWARD_TIMEOUT for sample in samples),
            # Prompts that cannot fit inference.max_model_len (data.on_bad_row = "skip").
            "skipped_prompts": sum(
                bool(group.samples) and all(s.mask_reason == PROMPT_TOO_LONG for s in group.samples)
                for group in batch.groups
            ),
            "completion_tokens": tokens,
            "completion_len_mean": tokens / max(len(samples), 1),
            **{f"finish_{reason.value}": finish[reason] / len(samples) for reason in FinishReason},
            # End-to-end throughput: trained tokens per second of the step (comparable across modes).
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "generation_time_s": generation_time,
            "barrier_time_s": barrier.get("barrier_time_s", 0.0),
            "weight_transfer_time_s": barrier.get("transfer_time_s", 0.0),
            # Proof of delivery, each step it ran (vLLM servers: rollflow.weights.delivery; LoRA adapters in
            # vLLM: also the value probe, rollflow.weights.vllm_lora).
            **{
                name: barrier[name]
                for name in ("delivery_check_time_s", "probe_time_s", "probe_logprob_diff")
                if name in barrier
            },
            **(
                {
                    "sleep_time_s": barrier.get("sleep_time_s", 0.0),
                    "wake_time_s": barrier.get("wake_time_s", 0.0),
                }
                if self.colocation is not None
                else {}
            ),
            "step_time_s": step_time,
            "elapsed_s": time.perf_counter() - self._started_at,
        }
        for group in batch.groups:
            for name, value in group.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        reward_part_means(metrics)
        metrics.update(result.metrics)
        return metrics

    def _record(self, batch: TrainBatch, metrics: dict[str, Any]) -> None:
        # A deleted run directory takes metrics, rollouts and configs with it while our open files write on:
        # stop at the first step after, naming it, instead of ending well with nothing kept.
        self._lock.check_held()
        self.history.append(metrics)
        self._mismatch_watch.observe(metrics)
        for sink in self._sinks:
            sink.log(metrics)
        every = self.config.logging.samples_every
        if every and batch.step % every == 0:
            rows = [
                (batch.step, group.prompt_index, s.sample_index, s.reward, s.masked, s.completion_text)
                for group in batch.groups
                for s in group.samples
            ][: self.config.logging.samples_max]
            for sink in self._sinks:
                if hasattr(sink, "log_samples"):
                    sink.log_samples(batch.step, rows)
        assert self._rollouts is not None
        for group in batch.groups:
            self._rollouts.log(
                {
                    "step": batch.step,
                    "prompt_index": group.prompt_index,
                    "rewards": [sample.reward for sample in group.samples],
                    "masked": [sample.masked for sample in group.samples],
                    "min_policy_version": min(s.min_policy_version for s in group.samples),
                    "completions": [sample.completion_text for sample in group.samples],
                }
            )
        log.debug("step done", **{k: v for k, v in metrics.items() if isinstance(v, int | float)})

    def _eval_due(self) -> bool:
        if self.evaluator is None:
            return False
        every = self.evaluator.evaluation.every
        return self.state.step >= self.config.orchestrator.steps or (
            every > 0 and self.state.step % every == 0
        )

    async def _evaluate(self) -> dict[str, float]:
        """Held-out evaluation on the engines' current weights (between steps: no weight update runs during
        it; its requests pass no staleness schedule and are never trained)."""
        metrics = await self.evaluator.evaluate(self.state.policy_version)
        self.eval_history.append({"step": self.state.step, **metrics})
        log.info("evaluated", step=self.state.step, **metrics)
        return metrics

    def _checkpoint_due(self) -> bool:
        every = self.config.checkpoint.every
        final = self.state.step >= self.config.orchestrator.steps
        return final or (every > 0 and self.state.step % every == 0)

    async def _save_checkpoint(self) -> None:
        self._lock.check_held()  # else the checkpoint would recreate the deleted directory
        path = await anyio.to_thread.run_sync(
            save_checkpoint,
            self.run_dir,
            self.state,
            self.trainer.save_checkpoint,
            self.config.checkpoint.keep,
        )
        log.info("checkpoint saved", path=str(path), step=self.state.step)


def _single_error(error: BaseException) -> BaseException:
    """``error``, or the one rollflow error inside nested exception groups (cancellations left out; several
    of one kind count as one: the first, the others logged): its message was written for the user (a prompt
    too long, a stuck reward), and the CLI reports it as such. A group that holds anything else (a bug, a
    crash) is kept whole, with every traceback."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    leaves: list[BaseException] = []
    stack: list[BaseException] = [error]
    while stack:
        current = stack.pop(0)
        if isinstance(current, BaseExceptionGroup):
            stack[:0] = list(current.exceptions)
        elif not isinstance(current, asyncio.CancelledError):
            leaves.append(current)
    kinds = {type(leaf) for leaf in leaves}
    if len(kinds) != 1 or not issubclass(kinds.pop(), RollflowError):
        return error
    for other in leaves[1:]:
        log.error("generation also failed", error=f"{type(other).__name__}: {other}")
    return leaves[0]


def _staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Per-sample staleness: mean, max and a histogram (``staleness_hist_K`` = samples K versions behind)."""
    if not staleness:
        return {}
    counts = Counter(staleness)
    return {
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": max(staleness),
        **{f"staleness_hist_{k}": counts[k] for k in sorted(counts)},
    }
