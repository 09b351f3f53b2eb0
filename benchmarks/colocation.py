"""Colocated servers (``inference.colocate = true``) against the same run without colocation, on the quickstart.

The README's ``rollflow run examples/quickstart.toml`` with ``inference.mode = "http"`` (2 torch engine servers
behind the router, weights broadcast over gloo), first without colocation (the baseline, in this same
invocation), then colocated at each sleep level: around every training step the servers sleep (level 1 frees
their KV caches, level 2 their weights too) and wake in two stages around the weight push. Prints one JSON line
per run: the mean reward of the first 5 and last 10 steps (the learning bar of ``tests/test_cli_run.py``:
first <= 0.6, last >= 0.9), the mean sleep and wake times per step, the mean step time and the wall time.
Then one line with the control calls server 0 recorded (``GET /control_log``) over a short colocated run: the
set-up push, then per step sleep ▸ wake_up(weights) ▸ push ▸ wake_up(kv_cache).

    python benchmarks/colocation.py [--schedule sync|one_step] [--steps 200] [--levels 1 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _quickstart import QUICKSTART, run_quickstart


def run(schedule: str, steps: int, level: int | None, directory: Path) -> dict:
    colocation = (
        ["inference.colocate=false"]
        if level is None
        else ["inference.colocate=true", f"inference.sleep_level={level}"]
    )
    overrides = [
        "inference.router_port=0",
        "inference.mode='http'",
        f"orchestrator.mode='{schedule}'",
        f"orchestrator.steps={steps}",
        "checkpoint.every=0",
        *colocation,
    ]
    metrics, elapsed = run_quickstart(directory, overrides, f"{schedule}, sleep level {level}")
    rewards = [m["reward_mean"] for m in metrics]
    return {
        "figure": "colocated_quickstart" if level is not None else "colocated_quickstart_baseline",
        "schedule": schedule,
        "colocate": level is not None,
        "sleep_level": level,
        "steps": len(metrics),
        "reward_first5": round(statistics.fmean(rewards[:5]), 4),
        "reward_last10": round(statistics.fmean(rewards[-10:]), 4),
        "sleep_time_s_mean": round(statistics.fmean(m.get("sleep_time_s", 0.0) for m in metrics), 4),
        "wake_time_s_mean": round(statistics.fmean(m.get("wake_time_s", 0.0) for m in metrics), 4),
        "step_time_s_mean": round(statistics.fmean(m["step_time_s"] for m in metrics), 4),
        "wall_s": round(elapsed, 1),
    }


async def recorded_sequence(schedule: str, level: int, directory: Path) -> dict:
    """Two colocated steps in process; the control calls server 0 recorded, in order."""
    import logging

    import aiohttp
    import structlog

    from rollflow.config import load_config
    from rollflow.orchestrator import Orchestrator

    # The run's log goes to stderr (warnings only): stdout holds the JSON lines.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    config = load_config(
        [QUICKSTART],
        [
            f"output_dir='{directory}'",
            "inference.mode='http'",
            "inference.router_port=0",
            "inference.colocate=true",
            f"inference.sleep_level={level}",
            f"orchestrator.mode='{schedule}'",
            "orchestrator.steps=2",
            "checkpoint.every=0",
        ],
    )
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run()
        url = orchestrator.client.server_urls[0]
        async with aiohttp.ClientSession() as http, http.get(f"{url}/control_log") as response:
            entries = (await response.json())["entries"]
    keep = ("event", "level", "mode", "tags", "version", "policy_version", "tokens_generated")
    return {
        "figure": "colocated_control_log",
        "schedule": schedule,
        "sleep_level": level,
        "server": 0,
        "entries": [{key: entry[key] for key in keep if key in entry} for entry in entries],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="sync", choices=["sync", "one_step"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--levels", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    for level in [None, *args.levels]:  # the baseline first
        with tempfile.TemporaryDirectory() as directory:
            print(json.dumps(run(args.schedule, args.steps, level, Path(directory))), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        sequence = asyncio.run(recorded_sequence(args.schedule, args.levels[0], Path(directory)))
    print(json.dumps(sequence), flush=True)


if __name__ == "__main__":
    main()
