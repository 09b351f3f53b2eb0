"""The quickstart learning with 2 data-parallel trainer workers against 1, with engine servers fed by weights the
trainer pushes (``inference.mode = "http"``, ``weight_sync.strategy = auto``: broadcast over gloo on a CPU).

Each schedule (``sync``, ``fully_async``) runs the README's ``rollflow run examples/quickstart.toml`` with
``trainer.num_workers = 1`` (the baseline, in this same invocation) and then ``2``, as subprocesses. Prints
one JSON line per run: the mean reward of the first 5 and the last 10 steps (the learning bar of
``tests/test_cli_run.py``: first <= 0.6, last >= 0.9), the engine-vs-trainer logprob mismatch over the
steps that sampled with the weights being trained (target < 1e-4), and the wall time.

    python benchmarks/quickstart_workers.py [--schedules sync fully_async] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from _quickstart import run_quickstart


def run(schedule: str, workers: int, steps: int, directory: Path) -> dict:
    metrics, elapsed = run_quickstart(
        directory,
        [
            "inference.router_port=0",
            "inference.mode='http'",
            f"orchestrator.mode='{schedule}'",
            f"orchestrator.steps={steps}",
            f"trainer.num_workers={workers}",
        ],
        f"{schedule}, {workers} worker(s)",
    )
    rewards = [m["reward_mean"] for m in metrics]
    on_policy = [m["logprob_mismatch"] for m in metrics if math.isfinite(m["logprob_mismatch"])]
    return {
        "figure": "quickstart_learning",
        "schedule": schedule,
        "num_workers": workers,
        "steps": len(metrics),
        "reward_first5": statistics.fmean(rewards[:5]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "logprob_mismatch_mean": statistics.fmean(on_policy) if on_policy else None,
        "logprob_mismatch_max": max(on_policy) if on_policy else None,
        "on_policy_steps": len(on_policy),
        "wall_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["sync", "fully_async"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for schedule in args.schedules:
        for workers in (1, 2):  # the 1-worker baseline first
            with tempfile.TemporaryDirectory() as directory:
                print(json.dumps(run(schedule, workers, args.steps, Path(directory))), flush=True)


if __name__ == "__main__":
    main()
