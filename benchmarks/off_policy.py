"""Behaviour corrections under a controlled sampler/trainer mismatch, each against none in one invocation.

The quickstart (``examples/quickstart.toml``: the tiny model learns the letter case a prompt asks for) runs
with its sampler at ``--sampler-temperature`` (1.5 by default) while the trainer computes logprobs at
``--trainer-temperature`` (1.0): the trainer trains pi at T = 1 on tokens drawn from pi at T = 1.5, the kind
of gap a sampler's numerics or a stale policy open, of a size known in advance. The knob is the trainer's
``temperature`` argument, set here by wrapping ``TrainerSpec.trainer_kwargs`` (the config has no key for a
wrong temperature, on purpose). Each correction (``CORRECTIONS``) trains once per staleness: ``sync``
(staleness 0) and ``fully_async`` with ``orchestrator.max_staleness`` 2 and 4; ``none`` is the baseline of
each.

Prints one JSON line per run: the final reward (mean of the last 10 steps), the first step whose reward
over the last 5 steps reaches 0.9 (null: never), and the drift metrics (``off_policy/*``, the means over
the run), then one summary line per staleness ranking the corrections by final reward.

    python benchmarks/off_policy.py [--quick] [--steps N] [--sampler-temperature 1.5]
        [--corrections none,tis_token,...] [--staleness 0,2,4]

``--quick`` (about 3 minutes on 2 cores): 3 corrections, staleness 0 and 4, 20 steps; the full set (8
corrections, 3 stalenesses, 40 steps) about 15 on 2 idle cores, twice that on busy ones (a run's steps
take 0.5 to 2.5 s each there). Neither reaches a reward of 0.9 at these lengths with this mismatch (the
quickstart itself trains 200 steps): compare the final rewards and the drift metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from rollflow import Orchestrator, eventloop, load_config

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.toml"

CORRECTIONS: dict[str, list[str]] = {
    "none": ["trainer.off_policy='none'"],
    "tis_token": ["trainer.off_policy.kind='tis'"],
    "tis_sequence": ["trainer.off_policy.kind='tis'", "trainer.off_policy.level='sequence'"],
    "mis_token": ["trainer.off_policy.kind='mis'"],
    "mis_sequence": ["trainer.off_policy.kind='mis'", "trainer.off_policy.level='sequence'"],
    # The temperature gap moves each token's log-ratio by tenths: a geometric bound of 1.001 (verl's
    # typical value for numerical mismatch) would drop every sequence, so it is wider here.
    "mis_geometric": [
        "trainer.off_policy.kind='mis'",
        "trainer.off_policy.level='geometric'",
        "trainer.off_policy.high=1.1",
    ],
    "icepop": ["trainer.off_policy.kind='icepop'"],
    "decoupled": ["trainer.off_policy.kind='decoupled'"],
    # The objectives that carry their own correction, against the behaviour logprobs.
    "cispo": [
        "trainer.off_policy='none'",
        "trainer.loss='cispo'",
        "trainer.clip_low=1.0",
        "trainer.clip_high=1.0",
    ],
    "gspo": [
        "trainer.off_policy='none'",
        "trainer.ratio_level='sequence'",
        "trainer.loss_agg='seq_mean_token_mean'",
        "trainer.clip_low=0.05",
        "trainer.clip_high=0.05",
    ],
}
FULL_CORRECTIONS = (
    "none",
    "tis_token",
    "tis_sequence",
    "mis_sequence",
    "mis_geometric",
    "icepop",
    "cispo",
    "gspo",
)
"""The default set (``mis_token`` and ``decoupled`` only with ``--corrections``: close to ``icepop``)."""
QUICK_CORRECTIONS = ("none", "tis_token", "icepop")


def with_trainer_temperature(temperature: float) -> None:
    """Make every trainer built from a ``TrainerSpec`` compute logprobs at ``temperature``."""
    from rollflow.train.process import TrainerSpec

    original = TrainerSpec.trainer_kwargs

    def trainer_kwargs(self):
        return {**original(self), "temperature": temperature}

    TrainerSpec.trainer_kwargs = trainer_kwargs


def steps_to(rewards: list[float], target: float, window: int = 5) -> int | None:
    """The first step (1-based) whose mean reward over the last ``window`` steps reaches ``target``."""
    for end in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[end - window : end]) >= target:
            return end
    return None


async def train(name: str, staleness: int, args, output_dir: str) -> dict:
    mode = "sync" if staleness == 0 else "fully_async"
    overrides = [
        f"name='{name}-s{staleness}'",
        f"output_dir='{output_dir}'",
        f"orchestrator.steps={args.steps}",
        f"orchestrator.mode='{mode}'",
        f"orchestrator.max_staleness={max(staleness, 1)}",
        f"sampling.temperature={args.sampler_temperature}",
        "checkpoint.every=0",
        f"trainer.mismatch_kl_threshold={args.kl_threshold}",
        *CORRECTIONS[name],
    ]
    config = load_config(QUICKSTART, overrides)
    started = time.perf_counter()
    async with Orchestrator(config) as orchestrator:
        history = await orchestrator.run()
    wall = time.perf_counter() - started
    rewards = [row["reward_mean"] for row in history]
    drift = {}
    for key in sorted({key for row in history for key in row if key.startswith("off_policy/")}):
        values = [row[key] for row in history if isinstance(row.get(key), float) and math.isfinite(row[key])]
        drift[key] = round(statistics.fmean(values), 5) if values else None
    return {
        "benchmark": "off_policy",
        "correction": name,
        "staleness": staleness,
        "mode": mode,
        "steps": len(history),
        "final_reward": round(statistics.fmean(rewards[-10:]), 4),
        "steps_to_0.9": steps_to(rewards, 0.9),
        "behaviour_staleness_mean": round(
            statistics.fmean(row.get("behaviour_staleness_mean", 0.0) for row in history), 3
        ),
        **drift,
        "wall_s": round(wall, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 corrections, staleness 0 and 4, 20 steps")
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default 40; quick 20)"
    )
    parser.add_argument("--sampler-temperature", type=float, default=1.5)
    parser.add_argument("--trainer-temperature", type=float, default=1.0)
    parser.add_argument("--corrections", default=None, help=f"comma-separated, of {', '.join(CORRECTIONS)}")
    parser.add_argument("--staleness", default=None, help="comma-separated max staleness; 0 is sync")
    parser.add_argument("--kl-threshold", type=float, default=0.01, help="trainer.mismatch_kl_threshold")
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.quick else 40)
    names = (
        args.corrections.split(",")
        if args.corrections
        else list(QUICK_CORRECTIONS if args.quick else FULL_CORRECTIONS)
    )
    unknown = [name for name in names if name not in CORRECTIONS]
    if unknown:
        raise SystemExit(f"--corrections: unknown {unknown}; use {', '.join(CORRECTIONS)}")
    stalenesses = [int(s) for s in (args.staleness or ("0,4" if args.quick else "0,2,4")).split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with_trainer_temperature(args.trainer_temperature)
    with tempfile.TemporaryDirectory() as output_dir:
        for staleness in stalenesses:
            rows = []
            for name in names:
                row = await train(name, staleness, args, output_dir)
                row["sampler_temperature"], row["trainer_temperature"] = (
                    args.sampler_temperature,
                    args.trainer_temperature,
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
            baseline = next((row for row in rows if row["correction"] == "none"), None)
            ranked = sorted(rows, key=lambda row: -row["final_reward"])
            print(
                json.dumps(
                    {
                        "benchmark": "off_policy",
                        "figure": "final_reward_by_correction",
                        "staleness": staleness,
                        "baseline_none": None if baseline is None else baseline["final_reward"],
                        "ranking": [
                            [row["correction"], row["final_reward"], row["steps_to_0.9"]] for row in ranked
                        ],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    eventloop.run(main())
