"""The quickstart with 2 trainer workers and 2 engine servers on Ray (``cluster.backend = "ray"``, a private
Ray instance: ``cluster.address = "local"``) against the same run with local processes, in this invocation.

Prints one JSON line per run: the mean reward of the first 5 and the last 10 steps (the learning bar of
``tests/test_cli_run.py``: first <= 0.6, last >= 0.9), the engine-vs-trainer logprob mismatch on on-policy
steps (< 1e-4: the servers sample with exactly the weights the workers pushed), the time to the first step
(start-up: Ray, actors, placement) and the wall time.

    python benchmarks/ray_quickstart.py [--steps 200] [--schedule sync]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from _quickstart import run_quickstart

RAY = ["cluster.backend='ray'", "cluster.address='local'", "cluster.num_cpus=4"]


def run(backend: str, schedule: str, steps: int, directory: Path) -> dict:
    overrides = [
        "inference.router_port=0",
        "inference.mode='http'",
        "trainer.num_workers=2",
        "inference.num_servers=2",
        f"orchestrator.mode='{schedule}'",
        f"orchestrator.steps={steps}",
        *(RAY if backend == "ray" else []),
    ]
    metrics, elapsed = run_quickstart(directory, overrides, backend)
    rewards = [m["reward_mean"] for m in metrics]
    on_policy = [m["logprob_mismatch"] for m in metrics if math.isfinite(m["logprob_mismatch"])]
    run_time = sum(m["step_time_s"] for m in metrics)
    return {
        "figure": "ray_quickstart_learning",
        "backend": backend,
        "schedule": schedule,
        "steps": len(metrics),
        "reward_first5": round(statistics.fmean(rewards[:5]), 4),
        "reward_last10": round(statistics.fmean(rewards[-10:]), 4),
        "logprob_mismatch_max": max(on_policy) if on_policy else None,
        "startup_s": round(elapsed - run_time, 1),
        "wall_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--schedule", default="sync")
    args = parser.parse_args()
    for backend in ("local", "ray"):  # the local baseline first
        with tempfile.TemporaryDirectory() as directory:
            print(json.dumps(run(backend, args.schedule, args.steps, Path(directory))), flush=True)


if __name__ == "__main__":
    main()
