"""Top-k/top-p sampling masks replayed in training (``trainer.sampling_mask``) against ignoring them.

Trains ``examples/quickstart.toml`` with each truncation (``--truncations``: ``top_k=20`` and ``top_p=0.9``)
twice, with ``trainer.sampling_mask = "replay"`` and with ``"ignore"`` (the baseline, in the same invocation),
then evaluates each run's final weights on held-out prompts (``[eval]``: the built-in task under another seed)
sampled WITHOUT truncation (``top_k = -1``, ``top_p = 1``): what the model itself learnt, not the sampler.
Prints one JSON line per run: that held-out reward (``eval_untruncated_reward``), the same with the run's
truncation, the training reward of the last 10 steps, the engine/trainer logprob mismatch (mean and worst
step), and the reported entropy over the last 10 steps (``ln(k)`` bounds the sampler's entropy under top-k).

    python benchmarks/sampling_mask.py [--steps 200] [--eval-samples 8] [--truncations top_k=20 top_p=0.9]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from rollflow import Orchestrator, load_config
from rollflow.rollout.evaluation import evaluate_offline

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = REPO_ROOT / "examples" / "quickstart.toml"
EVAL_SEED = 1000


async def measure(truncation: str, mode: str, steps: int, eval_samples: int, output_dir: str) -> dict:
    name = f"{truncation.replace('=', '')}-{mode}"
    held_out = [f"eval.seed={EVAL_SEED}", "eval.num_prompts=64", f"eval.samples={eval_samples}"]
    overrides = [
        f"output_dir='{output_dir}'",
        f"name='{name}'",
        "checkpoint.every=0",
        f"orchestrator.steps={steps}",
        f"sampling.{truncation}",
        f"trainer.sampling_mask={mode}",
    ]
    config = load_config([QUICKSTART], overrides)
    started = time.perf_counter()
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
    train_s = time.perf_counter() - started
    run_dir = config.run_dir
    plain = load_config([QUICKSTART], [*overrides, *held_out, "sampling.top_k=-1", "sampling.top_p=1.0"])
    truncated = load_config([QUICKSTART], [*overrides, *held_out])
    untruncated_eval = await evaluate_offline(plain, checkpoint=run_dir)
    truncated_eval = await evaluate_offline(truncated, checkpoint=run_dir)
    mismatches = [
        m["logprob_mismatch"] for m in metrics if math.isfinite(m.get("logprob_mismatch", math.nan))
    ]
    line = {
        "run": name,
        "truncation": truncation,
        "sampling_mask": mode,
        "steps": len(metrics),
        "eval_untruncated_reward": untruncated_eval["eval/sampled/reward_mean"],
        "eval_truncated_reward": truncated_eval["eval/sampled/reward_mean"],
        "eval_greedy_reward": untruncated_eval["eval/greedy/reward_mean"],
        "train_reward_last10": statistics.fmean(m["reward_mean"] for m in metrics[-10:]),
        "logprob_mismatch_mean": statistics.fmean(mismatches),
        "logprob_mismatch_max_step": max(mismatches),
        "entropy_last10": statistics.fmean(m["entropy"] for m in metrics[-10:]),
        "train_s": train_s,
    }
    if truncation.startswith("top_k="):
        line["entropy_bound_ln_k"] = math.log(int(truncation.split("=")[1]))
    return line


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--truncations", nargs="+", default=["top_k=20", "top_p=0.9"])
    parser.add_argument("--modes", nargs="+", default=["replay", "ignore"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for truncation in args.truncations:
            for mode in args.modes:
                line = await measure(truncation, mode, args.steps, args.eval_samples, tmp)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    anyio.run(main)
