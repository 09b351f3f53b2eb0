"""Wall-clock speed-up of ``fully_async`` over ``sync`` on one workload with long-tailed response lengths.

Engine servers run in their own processes (``inference.mode = "http"``, 2 servers behind the router); the
trainer runs in a worker thread of this process, so generation and training can overlap on the two cores.
Response lengths are long-tailed: each request's ``max_tokens`` is drawn from a Pareto distribution (the tiny
random model rarely stops early, so the budget is the length).

The ideal overlap bound comes from the sync run itself: ``(T_gen + T_train) / max(T_gen, T_train)``, where
``T_gen`` is the time the sync loop waited for its batches and ``T_train`` the time it spent training and
updating weights. Prints one JSON line per figure.

    python benchmarks/async_speedup.py [--steps 12] [--warmup 2] [--trainer-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import anyio
import msgspec

from rollflow import Orchestrator, load_config
from rollflow.inference.setup import get_inference_client


class LongTailClient:
    """Draws each request's token budget from a Pareto tail (seeded), then forwards to the real client."""

    def __init__(self, inner, max_tokens: int, seed: int = 0):
        self.inner = inner
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)

    async def generate(self, request):
        budget = min(self.max_tokens, max(2, int(4 * self.rng.paretovariate(1.2))))
        sampling = msgspec.structs.replace(request.sampling, max_tokens=budget)
        return await self.inner.generate(msgspec.structs.replace(request, sampling=sampling))

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def measure(
    mode: str, steps: int, warmup: int, output_dir: str, trainer_threads: int
) -> dict[str, float]:
    config = load_config(
        [],
        [
            f"output_dir='{output_dir}'",
            f"name={mode}",
            "inference.mode='http'",
            "inference.num_servers=2",
            "inference.router_port=0",
            f"orchestrator.mode='{mode}'",
            "orchestrator.max_staleness=2",
            "orchestrator.prompts_per_step=8",
            f"orchestrator.steps={steps + warmup}",
            "sampling.samples_per_prompt=8",
            "sampling.max_tokens=96",
            "trainer.micro_batch_size=64",
            # Two server processes and the trainer share 2 cores: one training thread overlaps best.
            f"trainer.num_threads={trainer_threads}",
        ],
    )
    async with get_inference_client(config, config.run_dir) as remote:
        client = LongTailClient(remote, max_tokens=config.sampling.max_tokens)
        async with Orchestrator(config, inference_client=client) as orchestrator:
            await orchestrator.run(steps=warmup)
            started = time.perf_counter()
            metrics = await orchestrator.run()
            wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "t_gen_s": sum(m["generation_time_s"] for m in metrics),
        "t_train_s": sum(m["train_time_s"] + m["barrier_time_s"] for m in metrics),
        "tokens": sum(m["completion_tokens"] for m in metrics),
        "staleness_mean": sum(m.get("staleness_mean", 0.0) for m in metrics) / len(metrics),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trainer-threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as output_dir:
        sync = await measure("sync", args.steps, args.warmup, output_dir, args.trainer_threads)
        fully_async = await measure("fully_async", args.steps, args.warmup, output_dir, args.trainer_threads)
    bound = (sync["t_gen_s"] + sync["t_train_s"]) / max(sync["t_gen_s"], sync["t_train_s"])
    speedup = sync["wall_s"] / fully_async["wall_s"]
    common = {
        "benchmark": "async_speedup",
        "steps": args.steps,
        "servers": 2,
        "trainer_threads": args.trainer_threads,
    }
    for name, run in (("sync", sync), ("fully_async", fully_async)):
        print(json.dumps({**common, "mode": name, **{k: round(v, 4) for k, v in run.items()}}))
    print(
        json.dumps(
            {
                **common,
                "figure": "speedup",
                "speedup": round(speedup, 3),
                "ideal_overlap_bound": round(bound, 3),
                "fraction_of_bound": round(speedup / bound, 3),
                "target_fraction": 0.85,
            }
        )
    )


if __name__ == "__main__":
    anyio.run(main)
