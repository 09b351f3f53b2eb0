"""``[logging]``: where step metrics go."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rollflow.config.base import NonNegative, Positive, Section


class LoggingConfig(Section):
    """Where step metrics go besides ``{run_dir}/metrics.jsonl``, which is always written (resume and
    ``rollflow plot`` read it)."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = msgspec.field(
        default_factory=lambda: ["jsonl"]
    )
    """Metric sinks: ``tensorboard`` (event files in ``{run_dir}/tensorboard``; needs the ``tensorboard``
    package), ``wandb`` (a run in ``{run_dir}/wandb``; ``pip install wandb``), ``mlflow`` (a run in the
    ``logging.mlflow_tracking_uri`` store; ``pip install mlflow``)."""
    samples_every: NonNegative = 0
    """Every N steps, log a table of sampled completions (prompt index, reward, completion) to the backends
    that show tables (tensorboard text, wandb table, mlflow table); 0: never. ``rollouts.jsonl`` has them all."""
    samples_max: Positive = 16
    """Rows in each samples table (the first samples of the step)."""
    wandb_project: str = "rollflow"
    """The wandb project; the wandb run is named after the rollflow run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: written under ``{run_dir}/wandb`` only (upload later with ``wandb sync``), as on clusters
    without network; ``online`` streams to the wandb server (needs ``wandb login``)."""
    mlflow_tracking_uri: str | None = None
    """The mlflow tracking store (a server URL or database URI); unset: SQLite at ``{run_dir}/mlflow.db``, artifacts
    in ``{run_dir}/mlartifacts`` (view with ``mlflow ui --backend-store-uri sqlite:///{run_dir}/mlflow.db``)."""
    mlflow_experiment: str = "rollflow"
    """The mlflow experiment; the mlflow run is named after the rollflow run."""
    prometheus_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    """Serve the latest step's metrics for Prometheus at ``http://{prometheus_host}:{port}/metrics`` while the
    run lives (``rollflow_<metric>`` gauges, read at scrape time; ``pip install prometheus_client``); 0 picks a
    free port (logged). Unset: no endpoint. The engine servers and the router have their own ``/metrics``."""
    prometheus_host: str = "127.0.0.1"
    """Interface of the orchestrator's Prometheus endpoint; another than loopback exposes it to the network."""
