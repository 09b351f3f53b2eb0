"""``rollflow plot``: PNG figures of one or more runs' ``metrics.jsonl``, runs compared on the same axes.

Each figure is a group of related metrics (reward, evaluation, loss, KL and logprob mismatch, rollout/trainer
drift, staleness, throughput, timings), one panel per metric against the step, one line per run; the
``pipeline`` figure stacks each stage's waits per step instead, with the overlap fraction (is an async run
overlapping?). A figure none of the runs has a
metric of is not written (``eval`` without an ``[eval]`` section). matplotlib is an optional extra
(``pip install 'rollflow[plot]'``), imported only here and only when plotting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollflow.errors import ConfigError
from rollflow.metrics import (
    PIPELINE_DEPTH_MAX,
    PIPELINE_OVERLAP,
    PIPELINE_STAGES,
    PIPELINE_WAIT_INPUT,
    PIPELINE_WAIT_OUTPUT,
)

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class FigureSpec:
    name: str
    """File name stem (``{name}.png``)."""
    title: str
    keys: tuple[str, ...] = ()
    """Metrics in this order, where a run has them."""
    match: Callable[[str], bool] | None = None
    """Further metrics by name (sorted), for families whose names are not known in advance (``eval/*``)."""
    draw: Callable[[Any, str, list[str], list[RunMetrics]], Any] | None = None
    """Draws the figure of these metrics (default: one panel per metric, one line per run)."""


def _draw_pipeline(Figure: Any, title: str, keys: list[str], runs: list[RunMetrics]) -> Any:
    """ "Is my async run actually overlapping?": per run, each stage's wait on its input and on its output,
    stacked per step (a stage that waits on its input is starved, one that waits on its output is ahead of
    the next); and the overlap fraction and fullest group channel of every run."""
    from matplotlib.ticker import MaxNLocator

    stages = [stage for stage in PIPELINE_STAGES if any(key.endswith("/" + stage) for key in keys)]
    stages += sorted({key.rsplit("/", 1)[1] for key in keys if "/wait_" in key} - set(stages))
    colors = {stage: f"C{index}" for index, stage in enumerate(stages)}
    figure = Figure(figsize=(11.0, 3.0 * (len(runs) + 1) + 0.6), layout="constrained")
    axes = figure.subplots(len(runs) + 1, 2, squeeze=False)
    for row, run in enumerate(runs):
        for column, (prefix, what) in enumerate(
            ((PIPELINE_WAIT_INPUT, "waiting on input (starved)"), (PIPELINE_WAIT_OUTPUT, "waiting on output"))
        ):
            ax = axes[row][column]
            bottom: dict[float, float] = {}
            for stage in stages:
                steps, values = run.series(prefix + stage)
                if not steps:
                    continue
                base = [bottom.get(step, 0.0) for step in steps]
                ax.bar(steps, values, bottom=base, color=colors[stage], label=stage, width=0.8)
                for step, value in zip(steps, values, strict=True):
                    bottom[step] = bottom.get(step, 0.0) + value
            ax.set_title(f"{run.label}: seconds {what}", fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if bottom:
                ax.legend(fontsize=7, ncols=2)
    for column, (key, name) in enumerate(
        (
            (PIPELINE_OVERLAP, "generation during train + barrier (fraction)"),
            (PIPELINE_DEPTH_MAX + "groups", ""),
        ),
    ):
        ax = axes[len(runs)][column]
        for run in runs:
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, label=run.label, marker="o" if len(steps) <= 3 else None, markersize=3)
        ax.set_title(f"{key}" + (f": {name}" if name else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    figure.suptitle(title + ("" if len(runs) > 1 else f" - {runs[0].label}"))
    return figure


def _is_kl(key: str) -> bool:
    return "kl" in key.split("/")[-1].split("_")


def _is_off_policy(key: str) -> bool:
    """The drift metrics of ``rollflow.train.off_policy_metrics`` (``off_policy/*``)."""
    return key.startswith("off_policy/")


OFF_POLICY_KEYS = (
    "off_policy/kl_k1",
    "off_policy/kl_k3",
    "off_policy/ratio_p1",
    "off_policy/ratio_p50",
    "off_policy/ratio_p99",
    "off_policy/masked_token_fraction",
    "off_policy/masked_seq_fraction",
    "off_policy/truncated_token_fraction",
    "off_policy/truncated_seq_fraction",
)
"""The drift figure's panels in this order (others of the family follow, sorted)."""

FIGURES = (
    FigureSpec(
        "reward",
        "Reward",
        ("reward_mean", "reward_std"),
        lambda key: key.startswith("reward/"),
    ),
    FigureSpec("eval", "Evaluation", (), lambda key: key.startswith("eval/")),
    FigureSpec("loss", "Loss", ("loss", "grad_norm", "entropy", "clip_fraction", "advantage_abs_mean")),
    FigureSpec(
        "kl",
        "KL and sampler/trainer logprob mismatch",
        ("logprob_mismatch", "logprob_mismatch_max", "is_weight_mean", "is_truncated_fraction"),
        _is_kl,
    ),
    FigureSpec(
        "off_policy",
        "Rollout/trainer drift and what the behaviour correction did",
        OFF_POLICY_KEYS,
        _is_off_policy,
    ),
    FigureSpec(
        "staleness",
        "Staleness (policy versions behind)",
        ("staleness_mean", "staleness_max", "behaviour_staleness_mean", "dropped_stale_groups"),
    ),
    FigureSpec(
        "throughput", "Throughput", ("tokens_per_s", "completion_len_mean", "finish_length", "num_samples")
    ),
    FigureSpec(
        "timings",
        "Timings per step (s) and idle fractions",
        (
            "step_time_s",
            "generation_time_s",
            "train_time_s",
            "barrier_time_s",
            "weight_transfer_time_s",
            "trainer_idle_fraction",
            "generator_idle_fraction",
        ),
    ),
    FigureSpec(
        "pipeline",
        "Is the run overlapping? Stage waits per step",
        (PIPELINE_OVERLAP,),
        lambda key: key.startswith("pipeline/"),
        draw=_draw_pipeline,
    ),
)


@dataclass
class RunMetrics:
    label: str
    records: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the records that have ``key`` as a finite number."""
        steps, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
        return steps, values

    def keys(self) -> set[str]:
        return {key for record in self.records for key in record}


def metrics_path(run: str | Path) -> Path:
    """``run``'s ``metrics.jsonl`` (``run`` is a run directory or the file itself).

    Raises:
        ConfigError: no such file.
    """
    run = Path(run)
    path = run if run.is_file() else run / METRICS_FILE
    if not path.is_file():
        what = "does not exist" if not run.exists() else f"has no {METRICS_FILE}"
        raise ConfigError(
            f"rollflow plot {run}: {what}; give a run directory (output_dir/name) or its {METRICS_FILE}"
        )
    return path


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The step records of a run, in step order; lines that are not JSON objects with a ``step`` (a torn last
    line) are skipped.

    Raises:
        ConfigError: the run has no ``metrics.jsonl`` or no step in it.
    """
    path = metrics_path(run)
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise ConfigError(f"rollflow plot: {path} has no step recorded yet; plot it after the first step")
    return sorted(records, key=lambda record: record["step"])


def _labels(runs: Sequence[Path]) -> list[str]:
    names = [run.name if run.is_dir() else run.parent.name for run in runs]
    if len(set(names)) == len(names):
        return names
    return [str(run) for run in runs]


def _require_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "rollflow plot needs matplotlib, an optional extra: pip install 'rollflow[plot]' "
            "(or pip install matplotlib)"
        ) from None
    return Figure


def plot_runs(runs: Sequence[str | Path], out: str | Path) -> list[Path]:
    """Write the PNG figures comparing ``runs`` into ``out`` (created); returns the files written.

    Raises:
        ConfigError: a run has no ``metrics.jsonl`` or no step, or matplotlib is not installed.
    """
    Figure = _require_matplotlib()
    paths = [Path(run) for run in runs]
    if not paths:
        raise ConfigError("rollflow plot: give at least one RUN directory")
    loaded = [
        RunMetrics(label, read_metrics(path)) for label, path in zip(_labels(paths), paths, strict=True)
    ]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    available = set().union(*(run.keys() for run in loaded))
    written = []
    for spec in FIGURES:
        keys = [key for key in spec.keys if key in available]
        if spec.match is not None:
            keys += sorted(key for key in available if spec.match(key) and key not in keys)
        keys = [key for key in keys if any(run.series(key)[0] for run in loaded)]
        if not keys:
            continue
        path = out / f"{spec.name}.png"
        draw = spec.draw or _draw
        draw(Figure, spec.title, keys, loaded).savefig(path, dpi=100)
        written.append(path)
    return written


def _draw(Figure: Any, title: str, keys: list[str], runs: list[RunMetrics]) -> Any:
    from matplotlib.ticker import MaxNLocator

    columns = min(len(keys), 2 if len(keys) <= 4 else 3)
    rows = math.ceil(len(keys) / columns)
    figure = Figure(figsize=(5.0 * columns, 3.2 * rows + 0.6), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for index, key in enumerate(keys):
        ax = axes[index // columns][index % columns]
        for run in runs:
            steps, values = run.series(key)
            if steps:
                # Sparse metrics (evaluation every N steps) get markers so single points show.
                sparse = len(steps) < 0.5 * len(run.records) or len(steps) <= 3
                ax.plot(steps, values, label=run.label, marker="o" if sparse else None, markersize=3)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    for index in range(len(keys), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle(title + ("" if len(runs) > 1 else f" - {runs[0].label}"))
    return figure
