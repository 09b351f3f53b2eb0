"""The orchestrator's setup: build a run's components in order (data, run directory, launcher, trainer,
inference client, barrier, generator, evaluator, schedule, colocation), start the engines on the trainer's
weights as policy version 0 or restore the last checkpoint, and open the metric sinks. A mixin of
``Orchestrator``, which declares the components; ``Orchestrator.run`` drives them."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from rollflow.config import RunConfig, to_json
from rollflow.errors import (
    CheckpointError,
    ConfigError,
    StorageError,
    describe_os_error,
)
from rollflow.metrics import JsonlWriter, truncate_jsonl_after_step
from rollflow.orchestrator.builders import build_barrier, load_chat, open_env, open_generator
from rollflow.orchestrator.checkpoint import (
    latest_checkpoint,
    load_state,
)
from rollflow.orchestrator.colocation import Colocation
from rollflow.orchestrator.run_dir import (
    CONFIG_FILE,
    clear_run_dir,
    latest_config,
    meaning_changes,
    write_resume_config,
)
from rollflow.orchestrator.schedules import StalenessSchedule
from rollflow.rollout.datasets import DatasetTask, steps_for_epochs, task_from_config
from rollflow.rollout.rewards import Rewarder

log = structlog.get_logger("rollflow.orchestrator.orchestrator")

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"


class OrchestratorSetup:
    """The setup half of ``Orchestrator``: ``setup`` and the steps it takes."""

    async def setup(self) -> None:
        """Load the task, models, engines and trainer; restore the last checkpoint when resuming."""
        if self._is_set_up:
            return
        default_log_level()
        from rollflow.inference.setup import get_inference_client
        from rollflow.launch.launcher import open_launcher
        from rollflow.tracking import check_backends, open_sinks

        config = self.config
        self._exit_stack = contextlib.AsyncExitStack()
        try:
            check_backends(config)  # a missing tracking package fails before any model loads
            # config.json records the renderer the run uses, not ``auto``.
            self.config = config = await anyio.to_thread.run_sync(_with_resolved_renderer, config)
            self._lock.acquire()
            self._exit_stack.callback(self._lock.release)
            # The data first: a bad file fails before anything is written, and epochs set the run's length.
            if config.env is not None:  # an environment's tasks are the prompts; it is held open for the run
                self.task = (await self._exit_stack.enter_async_context(open_env(config))).task
            else:
                self.task = await anyio.to_thread.run_sync(task_from_config, config.data)
            rewarder = Rewarder.from_config(
                config.data.reward, self.task, config.data.rewards, timeout_s=config.data.reward_timeout_s
            )
            config = self.config = self._with_epoch_steps(config)
            checkpoint = self._prepare_run_dir()
            # Where the trainer workers and servers run (cluster.backend): on Ray, the placement is granted here.
            self.launcher = await self._exit_stack.enter_async_context(open_launcher(config, self.run_dir))
            renderer, tokenizer, self.trainer = await anyio.to_thread.run_sync(self._build_trainer_side)
            self._exit_stack.callback(self.trainer.close)
            self.client = self._given_client or await self._exit_stack.enter_async_context(
                get_inference_client(config, self.run_dir, launcher=self.launcher)
            )
            self.barrier = build_barrier(config, self.client, self.launcher.rank0_address)
            self._exit_stack.callback(self.barrier.close)
            # Agent rollouts ([agent]): each sample is an agent session through the TITO proxy.
            self.generator = await self._exit_stack.enter_async_context(
                open_generator(config, self.client, renderer, tokenizer, self.task, rewarder)
            )
            limit = getattr(self.generator, "prompt_limit", None)
            if limit is not None and isinstance(self.task, DatasetTask):
                # Rows too long to fit by their length alone fail here (on_bad_row = "fail"), not mid-run.
                await anyio.to_thread.run_sync(limit.check_items, self.task.items)
            if config.eval is not None and config.env is not None:  # the environment's held-out tasks
                from rollflow.orchestrator.env_eval import open_env_evaluator

                self.evaluator = await self._exit_stack.enter_async_context(
                    open_env_evaluator(config, self.client, renderer, tokenizer, self.task.source)
                )
            elif config.eval is not None:
                from rollflow.rollout.evaluation import Evaluator

                self.evaluator = await anyio.to_thread.run_sync(
                    Evaluator, config, self.client, renderer, None, tokenizer
                )
            self.schedule = StalenessSchedule.from_config(config.orchestrator, policy_version=0, steps_done=0)
            self.colocation = Colocation.from_config(config, self.client, self.schedule.pause_mode)
            if checkpoint is not None:
                await self._restore(checkpoint)
            else:
                # The engines may hold other weights than the trainer's (servers that served an earlier run
                # keep its last ones): start them on the trainer's, as policy version 0, so that every
                # sample's version says which weights sampled it.
                await self.barrier.update(self.trainer, 0, self.schedule.pause_mode)
                if self.resume:  # stopped before its first checkpoint: every step is redone
                    for name in (METRICS_FILE, ROLLOUTS_FILE):
                        # -1: the evaluation before training (a step-0 record) is redone as well.
                        truncate_jsonl_after_step(self.run_dir / name, -1)
            self._sinks = [JsonlWriter(self.run_dir / METRICS_FILE), *self._extra_sinks]
            self._rollouts = JsonlWriter(self.run_dir / ROLLOUTS_FILE)
            # The tracking backends ([logging]) come after metrics.jsonl, before the caller's sinks.
            self._sinks[1:1] = await anyio.to_thread.run_sync(
                open_sinks, config, self.run_dir, self.state.step, self.resume
            )
        except BaseException as error:
            # The error goes to each exit: the servers' then name one that died under it (ServerDiedError).
            with anyio.CancelScope(shield=True):
                await self._exit_stack.__aexit__(type(error), error, error.__traceback__)
            raise
        self._is_set_up = True
        log.info(
            "orchestrator ready",
            run_dir=str(self.run_dir),
            inference_mode=config.inference.mode,
            step=self.state.step,
            policy_version=self.state.policy_version,
        )

    def _with_epoch_steps(self, config: RunConfig) -> RunConfig:
        """``data.epochs`` over a dataset: the run's length in steps, in place of ``orchestrator.steps``."""
        if config.data.epochs is None:
            return config
        steps = steps_for_epochs(config.data.epochs, len(self.task), config.orchestrator.prompts_per_step)
        log.info("run length from data.epochs", epochs=config.data.epochs, rows=len(self.task), steps=steps)
        return msgspec.structs.replace(
            config, orchestrator=msgspec.structs.replace(config.orchestrator, steps=steps)
        )

    def _prepare_run_dir(self) -> Path | None:
        """Check the (locked) run directory for a fresh run or a resume and record the config; returns the
        checkpoint to resume from (None: start at step 0)."""
        checkpoint = latest_checkpoint(self.run_dir)
        has_metrics = (self.run_dir / METRICS_FILE).exists()
        config_json = to_json(self.config) + b"\n"
        if not self.resume:
            if (checkpoint is not None or has_metrics) and self.overwrite:
                log.warning("overwriting the run", run_dir=str(self.run_dir))
                clear_run_dir(self.run_dir)
            elif checkpoint is not None or has_metrics:
                hint = (
                    "resume it with"
                    if checkpoint is not None
                    else "it has no checkpoint yet: restart it from step 0 with"
                )
                raise ConfigError(
                    f"run directory {self.run_dir} already holds a run: {hint} "
                    f"`rollflow run --resume {self.run_dir}` (in Python: Orchestrator(config, resume=True)), "
                    "start it over deleting its checkpoints and metrics (Orchestrator(config, overwrite=True)), "
                    "or pick another `name` (e.g. --set name=...)"
                )
            # Nothing was trained or recorded here (at most a run stopped during setup): start afresh.
            _write_file(self.run_dir / CONFIG_FILE, config_json)
            return None
        saved = latest_config(self.run_dir)
        if saved is None and checkpoint is None:
            raise CheckpointError(
                f"cannot resume {self.run_dir}: no run was started there (no {CONFIG_FILE}) and it has no "
                f"complete checkpoint under {self.run_dir / 'checkpoints'}; start it with `rollflow run CONFIG`"
            )
        if checkpoint is not None and saved is not None and not self.force:
            from rollflow.config import read_toml_or_json, to_dict

            changes = meaning_changes(read_toml_or_json(saved), to_dict(self.config))
            if changes:
                raise ConfigError(
                    f"--resume {self.run_dir}: the config changes what the run means since {saved.name} ("
                    + "; ".join(changes)
                    + "): its checkpoints and metrics would mix two experiments. Start a new run (another "
                    "`name`), or resume anyway with --force (Orchestrator(..., force=True))"
                )
        if saved is None:
            _write_file(self.run_dir / CONFIG_FILE, config_json)
        else:
            recorded = write_resume_config(self.run_dir, config_json)
            log.info("resume config recorded", path=str(recorded))
        if checkpoint is None:
            log.info("no checkpoint yet: the resumed run starts from step 0", run_dir=str(self.run_dir))
        return checkpoint

    def _build_trainer_side(self) -> tuple[Any, Any, Any]:
        """Blocking: load the chat renderer, the tokenizer and have the launcher start the trainer (in this
        process, a trainer process, local worker processes or Ray actors)."""
        from rollflow.models.loading import check_devices, resolve_model_path
        from rollflow.train.process import TrainerSpec

        config = self.config
        if config.cluster.backend == "local":  # on Ray, the devices are the nodes', not this machine's
            check_devices(config)  # before any model loads or process starts
        model_dir = resolve_model_path(config.model.path)
        if config.trainer.lora is not None:  # the model's modules against [trainer.lora], before any start
            from rollflow.train.lora import check_lora_targets

            check_lora_targets(config.trainer.lora, model_dir)
        tokenizer, renderer = load_chat(config, model_dir)
        spec = TrainerSpec(
            model_dir=model_dir,
            config=config.trainer,
            temperature=config.sampling.temperature,
            pad_token_id=tokenizer.pad_token_id or 0,
            seed=config.seed,
            off_policy=config.trainer.off_policy_correction(config.orchestrator.mode),
            total_steps=config.orchestrator.steps,
        )
        return renderer, tokenizer, self.launcher.start_trainer(spec)

    async def _restore(self, checkpoint: Path) -> None:
        self.state = load_state(checkpoint)
        await anyio.to_thread.run_sync(self.trainer.load_checkpoint, checkpoint)
        await self.barrier.update(self.trainer, self.state.policy_version, self.schedule.pause_mode)
        # Work done after the checkpoint is redone; drop its records so each step is logged once.
        for name in (METRICS_FILE, ROLLOUTS_FILE):
            truncate_jsonl_after_step(self.run_dir / name, self.state.step)
        log.info("resumed", checkpoint=str(checkpoint), step=self.state.step)


def default_log_level(level: int = logging.INFO) -> None:
    """Log at ``level`` and above when nobody configured structlog (the embedded API in a notebook or a
    script; the CLI configures it itself): structlog's own default prints every debug line, one per weight
    update and request. A configuration the caller made is left as it is."""
    if not structlog.is_configured():
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))


def _write_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary name, then a rename).

    Raises:
        StorageError: the write failed (disk full, permissions); the message names the path.
    """
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise StorageError(describe_os_error(error, path)) from None


def _with_resolved_renderer(config: RunConfig) -> RunConfig:
    """Blocking: ``config`` with ``model.renderer = "auto"`` replaced by the renderer it resolves to."""
    from rollflow.models.loading import resolve_model_path, resolve_renderer_name

    if config.model.renderer != "auto":
        return config
    name = resolve_renderer_name(config.model, resolve_model_path(config.model.path))
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, renderer=name))
