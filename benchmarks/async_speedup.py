"""Wall-clock speed-up of ``fully_async`` over ``sync`` on one workload with long-tailed response lengths.

Engine servers run in their own processes (``inference.mode = "http"``; with ``--servers`` above one, behind
a router in a process of its own). The trainer runs in a process of its own (``trainer.placement``,
``--placement thread`` for a worker thread of this process), so generation and training overlap on the two
cores without sharing an interpreter lock. The servers run ``--niceness`` below the trainer's CPU priority
(``inference.niceness``): generation is the stage with slack, and its frequent wake-ups would otherwise
preempt training steps. The default is one server: each stage then has a core of its own in both modes, so
the bound below is physically reachable. With two servers generation alone fills both cores in the sync
run, and the trainer's core in the async run is taken from it: the bound, which assumes each stage keeps its
sync speed, then overstates what two cores can do.
Response lengths are long-tailed: each request's ``max_tokens`` is drawn from a Pareto distribution (the tiny
random model rarely stops early, so the budget is the length).

The ideal overlap bound comes from the sync run itself: ``(T_gen + T_train) / max(T_gen, T_train)``, where
``T_gen`` is the time the sync loop waited for its batches and ``T_train`` the time it spent training and
updating weights. Each mode trains ``--warmup + --steps`` steps in one ``run()`` call and the clock covers
the last ``--steps`` (steady state: the async pipeline is full when the clock starts). The modes alternate
``--repeats`` times, since the machine is shared and noisy; the summary line gives the medians and each
repeat's fraction of the bound. Prints one JSON line per run and one summary line.

    python benchmarks/async_speedup.py [--steps 12] [--warmup 2] [--repeats 3] [--servers 1]
        [--placement process|thread] [--niceness 10] [--router auto|always] [--trainer-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import msgspec

from rollflow import Orchestrator, eventloop, load_config
from rollflow.inference.setup import get_inference_client


class LongTailClient:
    """Gives each request a token budget from a Pareto tail, then forwards to the real client.

    The budget depends only on the seed and the request id (``p{prompt}-s{sample}``), so both modes
    generate the same lengths for the same samples, whatever order their requests come in.
    """

    def __init__(self, inner, max_tokens: int, seed: int = 0):
        self.inner = inner
        self.max_tokens = max_tokens
        self.seed = seed

    async def generate(self, request):
        draw = random.Random(f"{self.seed}:{request.request_id}").paretovariate(1.2)
        budget = min(self.max_tokens, max(2, int(4 * draw)))
        sampling = msgspec.structs.replace(request.sampling, max_tokens=budget)
        return await self.inner.generate(msgspec.structs.replace(request, sampling=sampling))

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def measure(
    mode: str,
    repeat: int,
    steps: int,
    warmup: int,
    output_dir: str,
    trainer_threads: int,
    servers: int,
    placement: str,
    niceness: int,
    router: str,
) -> dict[str, float]:
    config = load_config(
        [],
        [
            f"output_dir='{output_dir}'",
            f"name={mode}-{repeat}",
            "inference.mode='http'",
            f"inference.num_servers={servers}",
            f"inference.niceness={niceness}",
            f"inference.router={router!r}",
            "inference.router_port=0",
            f"orchestrator.mode='{mode}'",
            "orchestrator.max_staleness=2",
            "orchestrator.prompts_per_step=8",
            f"orchestrator.steps={steps + warmup}",
            "sampling.samples_per_prompt=8",
            "sampling.max_tokens=96",
            "trainer.micro_batch_size=64",
            f"trainer.placement={placement!r}",
            # The servers and the trainer share 2 cores: one training thread overlaps best.
            f"trainer.num_threads={trainer_threads}",
        ],
    )
    async with get_inference_client(config, config.run_dir) as remote:
        client = LongTailClient(remote, max_tokens=config.sampling.max_tokens)
        async with Orchestrator(config, inference_client=client) as orchestrator:
            # One run() call: the warm-up steps fill the pipeline, and the clock starts when the last of
            # them ends (a second run() call would start async generation from empty again).
            step_ended: list[float] = []
            metrics = await orchestrator.run(on_step=lambda _: step_ended.append(time.perf_counter()))
    wall = step_ended[-1] - step_ended[warmup - 1] if warmup else step_ended[-1] - step_ended[0]
    metrics = metrics[warmup:] if warmup else metrics[1:]
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
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--niceness", type=int, default=10, help="inference.niceness of both modes")
    parser.add_argument(
        "--router",
        choices=["auto", "always"],
        default="auto",
        help="inference.router (auto: none for one server)",
    )
    parser.add_argument(
        "--placement",
        choices=["thread", "process"],
        default="process",
        help="trainer.placement of both modes",
    )
    parser.add_argument("--repeats", type=int, default=3, help="sync/fully_async pairs; medians reported")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common = {
        "benchmark": "async_speedup",
        "steps": args.steps,
        "servers": args.servers,
        "trainer_threads": args.trainer_threads,
        "placement": args.placement,
        "niceness": args.niceness,
        "router": args.router,
    }
    speedups, bounds, token_ratios = [], [], []
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(args.repeats):
            # Alternating the modes spreads the shared machine's noise over both.
            runs = {
                mode: await measure(
                    mode,
                    repeat,
                    args.steps,
                    args.warmup,
                    output_dir,
                    args.trainer_threads,
                    args.servers,
                    args.placement,
                    args.niceness,
                    args.router,
                )
                for mode in ("sync", "fully_async")
            }
            for mode, run in runs.items():
                figures = {k: round(v, 4) for k, v in run.items()}
                print(json.dumps({**common, "repeat": repeat, "mode": mode, **figures}), flush=True)
            sync = runs["sync"]
            bounds.append((sync["t_gen_s"] + sync["t_train_s"]) / max(sync["t_gen_s"], sync["t_train_s"]))
            speedups.append(sync["wall_s"] / runs["fully_async"]["wall_s"])
            token_ratios.append(runs["fully_async"]["tokens"] / sync["tokens"])
    fractions = [speedup / bound for speedup, bound in zip(speedups, bounds, strict=True)]
    print(
        json.dumps(
            {
                **common,
                "figure": "speedup",
                "repeats": args.repeats,
                "speedup": round(statistics.median(speedups), 3),
                "ideal_overlap_bound": round(statistics.median(bounds), 3),
                "fraction_of_bound": round(statistics.median(fractions), 3),
                "fraction_of_bound_each": [round(f, 3) for f in fractions],
                "target_fraction": 0.85,
                # The timed steps of the async run train groups in completion order, so their token count
                # differs a little from the sync run's (above 1: async did more work in its time).
                "async_tokens_vs_sync": round(statistics.median(token_ratios), 4),
            }
        )
    )


if __name__ == "__main__":
    # The loop `rollflow run` uses (uvloop when installed): the router and client share the trainer's process.
    eventloop.run(main())
