"""What each ``[logging] backends`` sink costs the orchestrator's event loop per step, against the
``metrics.jsonl`` writer every run has (the baseline, measured in the same run).

Each sink gets ``--steps`` records shaped like the quickstart's step metrics (about 45 numbers) through its
``log`` call, as the orchestrator calls it after each step; the time of those calls is what the loop is
blocked for. Setup and close (wandb starts and stops its service) are timed apart. A backend whose package
is missing is reported as skipped. Prints one JSON line per sink:

    python benchmarks/tracking_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rollflow import load_config
from rollflow.metrics import JsonlWriter
from rollflow.tracking import MlflowSink, PrometheusSink, TensorBoardSink, WandbSink

KEYS = [f"metric_{index}" for index in range(44)]


def record(step: int, rng: random.Random) -> dict[str, float]:
    return {"step": step, **{key: rng.random() for key in KEYS}}


def measure(name: str, open_sink, steps: int) -> dict:
    rng = random.Random(0)
    started = time.perf_counter()
    sink = open_sink()
    opened = time.perf_counter()
    durations = []
    for step in range(1, steps + 1):
        metrics = record(step, rng)
        begin = time.perf_counter()
        sink.log(metrics)
        durations.append(time.perf_counter() - begin)
    closing = time.perf_counter()
    sink.close()
    closed = time.perf_counter()
    return {
        "sink": name,
        "steps": steps,
        "log_ms_median": 1e3 * statistics.median(durations),
        "log_ms_p90": 1e3 * sorted(durations)[int(0.9 * len(durations))],
        "open_s": opened - started,
        "close_s": closed - closing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as root:
        run_dir = Path(root) / "run"
        config = load_config([], [f"output_dir='{root}'", "name=run"])
        sinks = {
            "jsonl": (None, lambda: JsonlWriter(run_dir / "metrics.jsonl")),
            "tensorboard": ("tensorboard", lambda: TensorBoardSink(run_dir / "tensorboard")),
            "wandb": ("wandb", lambda: WandbSink(config, run_dir)),
            "mlflow": ("mlflow", lambda: MlflowSink(config, run_dir)),
            "prometheus": ("prometheus_client", lambda: PrometheusSink("127.0.0.1", 0)),
        }
        baseline = None
        for name, (module, open_sink) in sinks.items():
            if module is not None and importlib.util.find_spec(module) is None:
                print(json.dumps({"sink": name, "skipped": f"{module} is not installed"}), flush=True)
                continue
            result = measure(name, open_sink, args.steps)
            if baseline is None:
                baseline = result["log_ms_median"]
            result["baseline_jsonl_log_ms_median"] = baseline
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
