"""Experiment-tracking metric sinks for ``[logging] backends``: TensorBoard, Weights & Biases and MLflow.

Each is an optional package, imported only when its backend is configured; a missing one is a ``ConfigError``
naming the install command, raised by ``check_backends`` before a run loads anything. wandb and MLflow work
offline by default (a wandb run directory under ``{run_dir}/wandb``, an MLflow SQLite store
``{run_dir}/mlflow.db`` with artifacts in ``{run_dir}/mlartifacts``), as on clusters without network. Every sink takes the step metrics (``log``) and, every
``logging.samples_every`` steps, a table of sampled completions (``log_samples``).
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


def open_sinks(config: RunConfig, run_dir: Path, steps_done: int = 0) -> list[Any]:
    """The tracking sinks ``logging.backends`` asks for (``jsonl`` is the run's own ``metrics.jsonl``, opened
    by the orchestrator). Blocking (wandb starts its service process).

    Args:
        steps_done: the step a resumed run continues after; TensorBoard hides what an earlier process logged
            beyond it (those steps are redone). wandb and MLflow start a new run per process.
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
                sinks.append(WandbSink(config, run_dir))
            elif name == "mlflow":
                sinks.append(MlflowSink(config, run_dir))
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


class WandbSink:
    """A wandb run named after the rollflow run, its config the run's config; ``logging.wandb_mode``
    ``offline`` writes it under ``{run_dir}/wandb`` only (``wandb sync`` uploads it later)."""

    def __init__(self, config: RunConfig, run_dir: Path):
        import wandb

        from rollflow.config import to_dict

        self._wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.logging.wandb_project,
            name=config.name,
            dir=str(run_dir),
            mode=config.logging.wandb_mode,
            config=to_dict(config),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log(numeric(metrics), step=int(metrics["step"]))

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[list(row) for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow metric names: alphanumerics, underscores, dashes, periods, spaces, colons and slashes.
_MLFLOW_INVALID = re.compile(r"[^\w\-. :/]")


class MlflowSink:
    """An MLflow run named after the rollflow run (params: the run's config, flattened) in experiment
    ``logging.mlflow_experiment`` of ``logging.mlflow_tracking_uri`` (default a file store in the run
    directory); samples tables as JSON artifacts ``samples/step_NNNNNN.json``."""

    def __init__(self, config: RunConfig, run_dir: Path):
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
        self.run_id = self._client.create_run(experiment_id, run_name=config.name).info.run_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-sink")
        self._writes: list[Future[Any]] = []
        self._log_params(_flatten(to_dict(config)))

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):  # the tracking API takes at most 100 params a call
            self._client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(metrics["step"]), int(time.time() * 1000)
        items = [
            Metric(_MLFLOW_INVALID.sub("_", key), value, now, step)
            for key, value in numeric(metrics).items()
            if math.isfinite(value)
        ]
        self._submit(self._log_metrics, items)

    def _log_metrics(self, items: list[Any]) -> None:
        for start in range(0, len(items), 1000):
            self._client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
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
