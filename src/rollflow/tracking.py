"""Experiment-tracking metric sinks for ``[logging] backends``: TensorBoard, Weights & Biases and MLflow.

Each is an optional package, imported only when its backend is configured; a missing one is a ``ConfigError``
naming the install command, raised by ``check_backends`` before a run loads anything. wandb and MLflow work
offline by default (a wandb run directory under ``{run_dir}/wandb``, an MLflow SQLite store
``{run_dir}/mlflow.db`` with artifacts in ``{run_dir}/mlartifacts``), as on clusters without network. Every sink takes the step metrics (``log``) and, every
``logging.samples_every`` steps, a table of sampled completions (``log_samples``).

A resumed rollflow run (``rollflow run --resume``) continues the same wandb run and the same MLflow run: their
ids are kept in the run directory (``wandb_run.json``, ``mlflow_run.json``) with the last step each logged.
Steps a resumed run redoes (those after its last checkpoint) are not logged to them again: wandb drops a step
below its last one, and MLflow would plot two points per step; their curves keep the first values of such a
step, while ``metrics.jsonl`` and TensorBoard hold the redone ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.errors import ConfigError, RollflowError

if TYPE_CHECKING:
    from rollflow.config import RunConfig

log = structlog.get_logger(__name__)

SAMPLE_COLUMNS = ("step", "prompt_index", "sample_index", "reward", "masked", "completion")
"""Columns of a samples table row (``log_samples``)."""

# Backend -> (module whose presence is checked, install command).
_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow"),
}


def check_backends(config: RunConfig) -> None:
    """Raise before a run starts when a configured backend's package is missing (nothing is imported).

    Raises:
        ConfigError: names ``logging.backends``, the backend and the install command.
    """
    backends = config.logging.backends
    duplicates = sorted({name for name in backends if backends.count(name) > 1})
    if duplicates:
        raise ConfigError(f"logging.backends = {backends!r} lists {', '.join(duplicates)} more than once")
    if config.logging.prometheus_port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            "logging.prometheus_port is set but the prometheus_client package is not installed: "
            "pip install prometheus_client, or unset logging.prometheus_port"
        )
    for name in backends:
        if name in _PACKAGES:
            module, command = _PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"logging.backends includes {name!r} but the {module} package is not installed: {command}, "
                    f"or remove {name!r} from logging.backends"
                )


def open_sinks(config: RunConfig, run_dir: Path, steps_done: int = 0, resume: bool = False) -> list[Any]:
    """The tracking sinks ``logging.backends`` asks for (``jsonl`` is the run's own ``metrics.jsonl``, opened
    by the orchestrator). Blocking (wandb starts its service process).

    Args:
        steps_done: the step a resumed run continues after; TensorBoard hides what an earlier process logged
            beyond it (those steps are redone).
        resume: the run is resumed (``--resume``): wandb and MLflow continue the runs recorded in ``run_dir``
            (``wandb_run.json``, ``mlflow_run.json``) and skip the steps those already hold; otherwise they
            start new runs.
    """
    check_backends(config)
    sinks: list[Any] = []
    try:
        for name in config.logging.backends:
            if name == "tensorboard":
                sinks.append(
                    TensorBoardSink(
                        run_dir / "tensorboard", purge_step=steps_done + 1 if steps_done else None
                    )
                )
            elif name == "wandb":
                sinks.append(WandbSink(config, run_dir, resume))
            elif name == "mlflow":
                sinks.append(MlflowSink(config, run_dir, resume))
        if config.logging.prometheus_port is not None:
            sinks.append(PrometheusSink(config.logging.prometheus_host, config.logging.prometheus_port))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite-or-NaN numbers of a step record (booleans as 0/1), without ``step``."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if key != "step" and isinstance(value, int | float)
    }


def samples_markdown(rows: Sequence[Sequence[Any]]) -> str:
    """A samples table as Markdown (TensorBoard renders it in its Text tab)."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardSink:
    """Scalars per step, and the samples table as Markdown text (tag ``samples``), in ``directory``."""

    def __init__(self, directory: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        for key, value in numeric(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        self._writer.add_text("samples", samples_markdown(rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _LoggedRun:
    """A tracking backend's run as recorded in the run directory (``{run_dir}/{name}``): its id and the last
    step logged to it, so that a resumed rollflow run continues it and skips the steps it already holds."""

    def __init__(self, path: Path, resume: bool):
        self.path = path
        self.record: dict[str, Any] = {}
        if resume and path.is_file():
            try:
                self.record = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                log.warning(
                    "tracking run record unreadable: a new run starts", path=str(path), error=str(error)
                )
        self.last_step: int | None = self.record.get("last_step")
        self._here: int | None = None  # the last step this process logged

    def fresh(self, step: int) -> bool:
        """Whether ``step`` is past every step logged to this run (by this process or an earlier one)."""
        return self.last_step is None or step > self.last_step

    def ours(self, step: int) -> bool:
        """Whether more of ``step`` may go to the run (its samples table): it is fresh or this process logged it."""
        return self.fresh(step) or step == self._here

    def save(self, **fields: Any) -> None:
        """Record ``fields`` (atomically: a crash leaves the old record or the new one)."""
        self.record.update(fields, last_step=self.last_step)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.record))
        partial.replace(self.path)

    def logged(self, step: int, save: bool = True) -> bool:
        """Note that ``step`` was logged; with ``save``, record it when it is a new last step. Returns whether
        it is."""
        self._here = step
        if self.last_step is not None and step <= self.last_step:
            return False
        self.last_step = step
        if save:
            self.save()
        return True


class WandbSink:
    """A wandb run named after the rollflow run, its config the run's config; ``logging.wandb_mode``
    ``offline`` writes it under ``{run_dir}/wandb`` only (``wandb sync`` uploads it later). A resumed rollflow
    run continues the same wandb run (its id is in ``{run_dir}/wandb_run.json``; offline, each process writes
    its own directory under the same id, which ``wandb sync`` joins)."""

    def __init__(self, config: RunConfig, run_dir: Path, resume: bool = False):
        import wandb

        from rollflow.config import to_dict

        self._wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self._logged = _LoggedRun(run_dir / "wandb_run.json", resume)
        run_id = self._logged.record.get("id")  # None: wandb picks a new one, recorded below
        self.run = wandb.init(
            project=config.logging.wandb_project,
            name=config.name,
            dir=str(run_dir),
            mode=config.logging.wandb_mode,
            id=run_id,
            resume="allow" if run_id else None,
            config=to_dict(config),
            allow_val_change=True,  # a resumed run may change keys (e.g. orchestrator.steps)
            settings=wandb.Settings(console="off", silent=True),
        )
        if self.run.starting_step:  # online: the server knows the run's last step, whatever our record says
            self._logged.last_step = max(self._logged.last_step or 0, self.run.starting_step - 1)
        self._logged.save(id=self.run.id)
        # Online, wandb itself knows the run's last step on resume (``starting_step``); offline it does not,
        # so each step is recorded (a file write and rename per step, which would triple an online log's cost).
        self._record_steps = config.logging.wandb_mode == "offline"

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        if self._logged.fresh(step):
            self.run.log(numeric(metrics), step=step)
            self._logged.logged(step, save=self._record_steps)

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        if self._logged.ours(step):
            table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[list(row) for row in rows])
            self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        if not self._record_steps:
            self._logged.save()  # the last step, for the record (online resumes go by the server's)
        self.run.finish()


# MLflow metric names: alphanumerics, underscores, dashes, periods, spaces, colons and slashes.
_MLFLOW_INVALID = re.compile(r"[^\w\-. :/]")


class MlflowSink:
    """An MLflow run named after the rollflow run (params: the run's config, flattened) in experiment
    ``logging.mlflow_experiment`` of ``logging.mlflow_tracking_uri`` (default a file store in the run
    directory); samples tables as JSON artifacts ``samples/step_NNNNNN.json``. A resumed rollflow run continues
    the same MLflow run (its id is in ``{run_dir}/mlflow_run.json``), logging the params it lacks."""

    def __init__(self, config: RunConfig, run_dir: Path, resume: bool = False):
        from mlflow.tracking import MlflowClient

        from rollflow.config import to_dict

        run_dir = run_dir.absolute()
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = config.logging.mlflow_tracking_uri or local_tracking_uri(run_dir)
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        name = config.logging.mlflow_experiment
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # A local store keeps its artifacts beside it, not in the working directory (mlflow's default).
            location = None if config.logging.mlflow_tracking_uri else (run_dir / "mlartifacts").as_uri()
            experiment_id = self._client.create_experiment(name, artifact_location=location)
        self._logged = _LoggedRun(run_dir / "mlflow_run.json", resume)
        params = _flatten(to_dict(config))
        resumed = self._resumed_run(uri)
        if resumed is not None:
            self.run_id = resumed.info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
            # MLflow refuses to change a logged param: only the new keys are logged.
            changed = sorted(k for k, v in resumed.data.params.items() if params.get(k, v)[:6000] != v)
            if changed:
                log.info("mlflow: params changed on resume keep their first values", params=changed)
            params = {k: v for k, v in params.items() if k not in resumed.data.params}
        else:
            self._logged.record, self._logged.last_step = {}, None  # a new run holds no step yet
            self.run_id = self._client.create_run(experiment_id, run_name=config.name).info.run_id
        self._logged.save(run_id=self.run_id, tracking_uri=uri)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-sink")
        self._writes: list[Future[Any]] = []
        self._log_params(params)

    def _resumed_run(self, uri: str) -> Any:
        """The MLflow run this run directory started, if it is in the store at ``uri``; else None."""
        run_id = self._logged.record.get("run_id")
        if not run_id:
            return None
        if self._logged.record.get("tracking_uri") != uri:
            log.warning(
                "mlflow: the tracking URI changed since the run started: a new MLflow run starts", uri=uri
            )
            return None
        try:
            return self._client.get_run(run_id)
        except Exception as error:  # deleted, or another store at the same URI
            log.warning(
                "mlflow: the run to continue is gone: a new MLflow run starts",
                run_id=run_id,
                error=str(error),
            )
            return None

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):  # the tracking API takes at most 100 params a call
            self._client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(metrics["step"]), int(time.time() * 1000)
        if not self._logged.fresh(step):
            return
        self._logged.logged(step, save=False)  # recorded on the sink's thread, once the metrics are written
        items = [
            Metric(_MLFLOW_INVALID.sub("_", key), value, now, step)
            for key, value in numeric(metrics).items()
            if math.isfinite(value)
        ]
        self._submit(self._log_metrics, items)

    def _log_metrics(self, items: list[Any]) -> None:
        for start in range(0, len(items), 1000):
            self._client.log_batch(self.run_id, metrics=items[start : start + 1000])
        self._logged.save()

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        if not self._logged.ours(step):
            return
        table = [dict(zip(SAMPLE_COLUMNS, row, strict=True)) for row in rows]
        self._submit(
            self._client.log_text, self.run_id, json.dumps(table, indent=1), f"samples/step_{step:06d}.json"
        )

    def _submit(self, function: Any, *args: Any) -> None:
        """Run a store write on the sink's own thread, in order: a SQLite commit takes tens of milliseconds,
        which the orchestrator's event loop must not wait for (``benchmarks/tracking_overhead.py``)."""
        self._check()
        self._writes.append(self._executor.submit(function, *args))

    def _check(self) -> None:
        """Raise the first failure of a finished write (the store is unreachable, the disk full)."""
        while self._writes and self._writes[0].done():
            error = self._writes.pop(0).exception()
            if error is not None:
                raise RollflowError(
                    f"logging.backends 'mlflow': writing to {self.tracking_uri} failed: {error}"
                ) from error

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._check()
        self._client.set_terminated(self.run_id)


_PROMETHEUS_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


class PrometheusSink:
    """The latest step's metrics as ``rollflow_<metric>`` gauges on a ``prometheus_client`` HTTP endpoint (its
    own thread): a collector reads them at scrape time, so a step costs one dict swap."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self._latest: dict[str, float] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise ConfigError(
                f"logging.prometheus_port = {port}: cannot listen on {host}:{port} ({error}); pick a free port "
                "(0 picks one)"
            ) from None
        self.port = self._server.server_port
        self.url = f"http://{host}:{self.port}/metrics"
        log.info("prometheus metrics", url=self.url)

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        for key, value in self._latest.items():  # the dict is replaced whole, never mutated
            name = "rollflow_" + _PROMETHEUS_INVALID.sub("_", key)
            yield GaugeMetricFamily(name, f"rollflow step metric {key} (latest step)", value=value)

    def log(self, metrics: dict[str, Any]) -> None:
        self._latest = {"step": float(metrics["step"]), **numeric(metrics)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def local_tracking_uri(run_dir: Path) -> str:
    """The default MLflow store of a run: SQLite at ``{run_dir}/mlflow.db`` (mlflow 3 keeps the file store in
    maintenance mode only)."""
    return f"sqlite:///{run_dir.absolute() / 'mlflow.db'}"


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return flat
