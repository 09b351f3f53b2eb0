"""Peak memory of the quickstart: glibc's default malloc arenas against the limit the CLI applies.

``rollflow run examples/quickstart.toml`` (embedded tiny model, sync mode, in-process engine) in a fresh process
per run, twice per variant, the variants alternated in this one invocation so both see the same (shared, noisy)
machine:

- ``limited``: as a user runs it; the CLI limits glibc's malloc arenas (``rollflow.malloc_arenas``).
- ``glibc_default``: ``MALLOC_ARENA_MAX`` set to glibc's own default, 8 per core, which the CLI leaves alone.

Peak RSS and CPU time come from ``wait4`` on each run's process. The mean reward over the last 10 steps shows
the limit does not change what is learnt (the runs are seeded: it is the same in both).

Prints one JSON line per run and one summary line:
{"benchmark": "memory", "variant": "limited", "run": 0, "steps": 200, "peak_rss_mib": ..., "cpu_s": ...,
 "wall_s": ..., "final_reward": ..., "load_1m": ...}
{"benchmark": "memory", "summary": true, "peak_rss_mib": ..., "baseline": "glibc_default",
 "baseline_peak_rss_mib": ..., "ratio": ..., ...}

Usage: ``python benchmarks/memory.py [--steps 200] [--repeats 2]`` (Linux, glibc; about 2 minutes per run on
2 CPU cores at 200 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quickstart import quickstart_command, read_metrics, run_measured

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def variants() -> dict[str, dict[str, str]]:
    glibc_default = str(8 * (os.cpu_count() or 1))
    return {"limited": {}, "glibc_default": {"MALLOC_ARENA_MAX": glibc_default}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if os.environ.get("MALLOC_ARENA_MAX"):
        parser.error("unset MALLOC_ARENA_MAX first: the variants set it themselves")
    overrides = [f"orchestrator.steps={args.steps}", "checkpoint.every=0"]
    results: dict[str, list[dict]] = {name: [] for name in variants()}
    for run in range(args.repeats):
        for name, env in variants().items():
            with tempfile.TemporaryDirectory() as directory:
                wall, peak, cpu = run_measured(quickstart_command(overrides), Path(directory), name, env)
                rows = read_metrics(Path(directory))
            final = statistics.fmean(row["reward_mean"] for row in rows[-10:])
            line = {
                "benchmark": "memory",
                "variant": name,
                "run": run,
                "steps": args.steps,
                "peak_rss_mib": round(peak, 1),
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "final_reward": round(final, 4),
                "load_1m": round(os.getloadavg()[0], 2),
                **({"malloc_arena_max": env["MALLOC_ARENA_MAX"]} if env else {}),
            }
            results[name].append(line)
            print(json.dumps(line), flush=True)
    limited, baseline = results["limited"], results["glibc_default"]
    peak = max(r["peak_rss_mib"] for r in limited)
    baseline_peak = max(r["peak_rss_mib"] for r in baseline)
    summary = {
        "benchmark": "memory",
        "summary": True,
        "steps": args.steps,
        "peak_rss_mib": peak,
        "baseline": "glibc_default",
        "baseline_peak_rss_mib": baseline_peak,
        "ratio": round(peak / baseline_peak, 3),
        "cpu_s_median": statistics.median(r["cpu_s"] for r in limited),
        "baseline_cpu_s_median": statistics.median(r["cpu_s"] for r in baseline),
        "final_reward": limited[-1]["final_reward"],
        "baseline_final_reward": baseline[-1]["final_reward"],
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
