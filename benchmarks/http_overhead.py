"""What the HTTP layer costs: client → router → 2 engine servers against the same engines in process.

Two measurements, each against a baseline taken in the same invocation (the machine is shared and noisy):

1. ``generation_throughput``: tokens/s of ``--requests`` generate calls (``--new-tokens`` each, no stop tokens)
   through ``RemoteInferenceClient`` → ``InferenceRouter`` → 2 ``rollflow serve`` subprocesses, against
   ``LocalInferenceClient`` over 2 ``TorchEngine``s in this process. Both sides alternate ``--repeats`` times;
   the figure is the median. Target: ratio ≥ 0.9. Each engine computes on one torch thread on both sides
   (``TorchEngine``'s default ``num_threads=1``, in the servers too), so neither side gets more cores.
2. ``router_latency``: ``--sessions`` concurrent sessions, each sending one 1-token generate request at once,
   through the router and directly to the servers (sessions spread round-robin). Reports requests/s and
   p50/p99 latency of both, and what the router adds.

Each side is warmed up with one run of the measured size before the repeats: after a smaller warm-up (8
prompts of 4 tokens) the first HTTP run read 0.77-0.91x the later ones (4 trials of 6 runs), a low first ratio;
after a full-size one it did not stand out.

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_prompts(count: int, vocab_size: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


async def run_generate(
    client, prompts: list[list[int]], new_tokens: int, session_prefix: str | None
) -> float:
    from rollflow.messages import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens, temperature=1.0)
    start = time.perf_counter()
    outputs = await asyncio.gather(
        *(
            client.generate(
                GenerateRequest(
                    prompt, sampling, session_id=f"{session_prefix}{i}" if session_prefix else None
                )
            )
            for i, prompt in enumerate(prompts)
        )
    )
    elapsed = time.perf_counter() - start
    tokens = sum(len(output.token_ids) for output in outputs)
    assert tokens == len(prompts) * new_tokens, (tokens, len(prompts), new_tokens)
    return tokens / elapsed


async def timed_posts(session, urls: list[str], body: bytes, count: int) -> tuple[float, list[float]]:
    """``count`` concurrent POSTs (request i to ``urls[i % len(urls)]``), each with its own session id."""
    latencies: list[float] = []

    async def one(index: int) -> None:
        start = time.perf_counter()
        async with session.post(
            f"{urls[index % len(urls)]}/inference/v1/generate",
            data=body,
            headers={"Content-Type": "application/json", "X-Session-ID": f"bench-{index}"},
        ) as response:
            await response.read()
            assert response.status == 200, response.status
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(index) for index in range(count)))
    return count / (time.perf_counter() - start), latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    import aiohttp
    import torch

    from rollflow.eventloop import tune_gc_for_serving
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.inference.router import InferenceRouter
    from rollflow.launch.server_group import ServerGroup
    from rollflow.models.loading import load_causal_lm, resolve_model_path

    torch.set_num_threads(1)
    model_dir = resolve_model_path("rollflow:tiny")
    engines = [TorchEngine(load_causal_lm(model_dir), max_batch_size=args.max_batch_size) for _ in range(2)]
    local = LocalInferenceClient(engines)
    prompts = make_prompts(args.requests, engines[0].vocab_size)
    log_dir = tempfile.mkdtemp(prefix="rollflow-bench-")
    options = {"max_batch_size": args.max_batch_size}
    async with (
        ServerGroup("rollflow:tiny", 2, log_dir, startup_timeout_s=300, server_options=options) as group,
        InferenceRouter(group.urls, health_check_interval_s=5.0) as router,
        RemoteInferenceClient(router.url, group.urls) as remote,
    ):
        # This process plays the run's: set up, it tunes its collector as `rollflow run` does (an older-generation
        # collection walking both engines' models stalled one HTTP repeat in every invocation, ratio ~0.2).
        tune_gc_for_serving()
        # Warm-up both paths at the measured size (threads, batch shapes, every connection the load opens).
        await run_generate(local, prompts, args.new_tokens, None)
        await asyncio.sleep(0.2)
        await run_generate(remote, prompts, args.new_tokens, None)
        local_rates, http_rates = [], []
        for _ in range(args.repeats):
            local_rates.append(await run_generate(local, prompts, args.new_tokens, None))
            await asyncio.sleep(0.2)  # lets the in-process engines' worker threads exit (see TorchEngine)
            http_rates.append(await run_generate(remote, prompts, args.new_tokens, None))
        local_tps, http_tps = statistics.median(local_rates), statistics.median(http_rates)
        print(
            json.dumps(
                {
                    "benchmark": "http_overhead",
                    "measurement": "generation_throughput",
                    "requests": args.requests,
                    "new_tokens": args.new_tokens,
                    "servers": 2,
                    "http_tokens_per_s": round(http_tps, 1),
                    "in_process_tokens_per_s": round(local_tps, 1),
                    "ratio": round(http_tps / local_tps, 3),
                    # Per repeat (each HTTP run against the in-process run just before it), for the spread.
                    "ratios": [
                        round(http / local, 3) for http, local in zip(http_rates, local_rates, strict=True)
                    ],
                    "http_tokens_per_s_runs": [round(rate, 1) for rate in http_rates],
                    "in_process_tokens_per_s_runs": [round(rate, 1) for rate in local_rates],
                    "target_ratio": 0.9,
                    "load_avg": [round(x, 2) for x in os.getloadavg()],
                }
            ),
            flush=True,
        )
        await local.close()

        body = json.dumps({"token_ids": prompts[0][:8], "sampling_params": {"max_tokens": 1}}).encode()
        # The router under test runs as its own process (`rollflow router`), as deployed; an in-process
        # router would share this load generator's event loop and measure the generator as much as itself.
        router_process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollflow", "router", "--port", "0", "--health-check-interval-s", "5",
            *(arg for url in group.urls for arg in ("--server", url)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            while not (line := await router_process.stdout.readline()).startswith(b'{"event": "ready"'):
                assert line, "rollflow router exited before it was ready"
            router_url = json.loads(line)["url"]
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                # Warm-up at the measured size: every connection the load opens, on both paths.
                await timed_posts(session, group.urls, body, args.sessions)
                await timed_posts(session, [router_url], body, args.sessions)
                direct_runs, routed_runs = [], []
                for _ in range(args.repeats):
                    direct_runs.append(await timed_posts(session, group.urls, body, args.sessions))
                    routed_runs.append(await timed_posts(session, [router_url], body, args.sessions))
        finally:
            router_process.terminate()
            await router_process.wait()

        def summary(runs):
            rate = statistics.median(run[0] for run in runs)
            latencies = [value for run in runs for value in run[1]]
            return rate, percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000

        direct, routed = summary(direct_runs), summary(routed_runs)
        print(
            json.dumps(
                {
                    "benchmark": "http_overhead",
                    "measurement": "router_latency",
                    "concurrent_sessions": args.sessions,
                    "max_tokens": 1,
                    "router_requests_per_s": round(routed[0], 1),
                    "direct_requests_per_s": round(direct[0], 1),
                    "router_p50_ms": round(routed[1], 2),
                    "direct_p50_ms": round(direct[1], 2),
                    "router_p99_ms": round(routed[2], 2),
                    "direct_p99_ms": round(direct[2], 2),
                    "added_p50_ms": round(routed[1] - direct[1], 2),
                    "added_p99_ms": round(routed[2] - direct[2], 2),
                    "ratios": [round(r[0] / d[0], 3) for r, d in zip(routed_runs, direct_runs, strict=True)],
                    "load_avg": [round(x, 2) for x in os.getloadavg()],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
