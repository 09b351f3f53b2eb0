"""The quickstart with several PPO updates per step against one (the default), in this same invocation.

Each schedule runs the README's ``rollflow run examples/quickstart.toml`` (embedded tiny model, local engines)
as a subprocess, first with the defaults (``trainer.ppo_epochs = 1``, ``trainer.mini_batches = 1``: the
baseline) and then with each ``--variant``. Prints one JSON line per run: the first step whose reward mean
reaches 0.95 (the quickstart's bar) and the mean reward of the last 10 steps, the clip fraction (mean, max,
and of the last pass), ``approx_kl``, the largest engine-vs-trainer logprob mismatch (target < 1e-4: measured
at the start of each step, before any update), and the training time.

    python benchmarks/ppo_updates.py [--schedules sync one_step] [--steps 200] [--variants 2x4 1x4 4x1]

A variant ``ExM`` is ``ppo_epochs = E``, ``mini_batches = M``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from _quickstart import run_quickstart

REWARD_BAR = 0.95


def run(schedule: str, epochs: int, mini_batches: int, steps: int, directory: Path) -> dict:
    overrides = [
        f"orchestrator.mode='{schedule}'",
        f"orchestrator.steps={steps}",
        f"trainer.ppo_epochs={epochs}",
        f"trainer.mini_batches={mini_batches}",
    ]
    metrics, elapsed = run_quickstart(directory, overrides, f"{schedule} {epochs}x{mini_batches}")
    rewards = [m["reward_mean"] for m in metrics]
    clip = [m["clip_fraction"] for m in metrics]
    last_pass = f"ppo_epoch_{epochs}/clip_fraction"
    mismatch = [m["logprob_mismatch"] for m in metrics if math.isfinite(m["logprob_mismatch"])]
    return {
        "figure": "quickstart_ppo_updates",
        "schedule": schedule,
        "ppo_epochs": epochs,
        "mini_batches": mini_batches,
        "baseline": epochs == 1 and mini_batches == 1,
        "steps": len(metrics),
        "first_step_reward_ge_0.95": next(
            (m["step"] for m in metrics if m["reward_mean"] >= REWARD_BAR), None
        ),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "clip_fraction_mean": statistics.fmean(clip),
        "clip_fraction_max": max(clip),
        "last_pass_clip_fraction_max": max((m[last_pass] for m in metrics if last_pass in m), default=None),
        "approx_kl_mean": statistics.fmean(m["approx_kl"] for m in metrics),
        "logprob_mismatch_max": max(mismatch) if mismatch else None,
        "num_updates_per_step": metrics[-1]["num_updates"],
        "train_time_s": round(math.fsum(m["train_time_s"] for m in metrics), 1),
        "wall_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["sync"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", nargs="+", default=["2x4"])
    args = parser.parse_args()
    variants = [tuple(int(part) for part in variant.split("x")) for variant in args.variants]
    for schedule in args.schedules:
        for epochs, mini_batches in [(1, 1), *variants]:  # the defaults' baseline first
            with tempfile.TemporaryDirectory() as directory:
                print(
                    json.dumps(run(schedule, epochs, mini_batches, args.steps, Path(directory))), flush=True
                )


if __name__ == "__main__":
    main()
