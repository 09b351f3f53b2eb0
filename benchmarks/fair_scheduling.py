"""One large request against ``rollflow serve``: does it hold back everyone else (issue 30, item 3)?

One ``rollflow serve`` subprocess (tiny model, ``--max-batch-size`` slots) per scheduling policy (``--shares``:
the server's ``--max-request-share``; ``none``, throughput first, is the default server). For each, in one
invocation:

1. ``short_latency_idle``: ``--requests`` short completions (a 4-token prompt, ``--short-tokens`` tokens, one
   at a time) on the idle server: the baseline.
2. ``short_latency_behind_hog``: the same while a hog request runs: one ``/v1/completions`` of ``--hog-prompts``
   prompts x ``n = --hog-n`` x ``--hog-tokens`` tokens (256 sequences by default, four times the batch), sent
   first and checked to still be running after the last short request. Reports the short requests' p50 and
   mean, and the p50 ratio behind the hog vs idle (target: at most 2).
3. ``hog_throughput``: the hog's tokens/s alone (1 s once it fills the batch) and while the short requests
   run: what putting latency first costs it.
4. ``oversized_request`` (unless ``--no-oversized``): the issue's 40 KB body (10,000 prompts x ``n = 64``): its
   status (400 with the ``--max-request-sequences`` limit) and how long the refusal took.

``engine_steps_p50`` counts the engine steps each short request spanned (``rollflow:engine_steps`` in
``/metrics``). Fair scheduling bounds the wait in steps (the short request is admitted at the next step), but
a step over a full batch costs several lone ones on a CPU, so with throughput first the wall-clock ratio is
about that cost (3-7x for the tiny model on a 2-core CPU). Latency first (``--max-request-share 0.125``:
8 of 64 slots while another request is in the engine) keeps the steps small while short requests come, and
the hog runs at a fraction of its rate meanwhile.

Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2),
        "max_ms": round(max(latencies) * 1000, 2),
    }


async def short_requests(session, url: str, count: int, tokens: int) -> tuple[list[float], list[int]]:
    """Latencies (s) of ``count`` short completions sent one at a time, and the engine steps each spanned."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    latencies, steps = [], []
    for _ in range(count):
        steps_before = await metric(session, url, "rollflow:engine_steps_total")
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
        latencies.append(time.perf_counter() - started)
        steps.append(await metric(session, url, "rollflow:engine_steps_total") - steps_before)
    return latencies, steps


async def metric(session, url: str, name: str) -> int:
    """One value from the server's ``/metrics`` (0 when the server does not export it)."""
    async with session.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(name + "{"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def tokens_generated(session, url: str) -> int:
    return await metric(session, url, "vllm:generation_tokens_total")


async def one_policy(args: argparse.Namespace, share: float | None) -> dict:
    """Idle and behind-the-hog latencies on a fresh server with ``--max-request-share share`` (None: off), and
    the hog's token rate alone and while the short requests run."""
    import aiohttp

    share_flags = [] if share is None else ["--max-request-share", str(share)]
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollflow", "serve", "--model", "rollflow:tiny", "--port", "0",
        "--max-batch-size", str(args.max_batch_size), "--max-model-len", str(args.hog_tokens + 16),
        *share_flags, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not (line := await server.stdout.readline()).startswith(b'{"event": "ready"'):
            assert line, "rollflow serve exited before it was ready"
        url = json.loads(line)["url"]
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await short_requests(session, url, 5, args.short_tokens)  # warm-up: first forward, thread start
            idle, idle_steps = await short_requests(session, url, args.requests, args.short_tokens)

            hog_body = {
                "prompt": [[9, 10, 11, 12 + i] for i in range(args.hog_prompts)],
                "n": args.hog_n,
                "max_tokens": args.hog_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            hog = asyncio.create_task(session.post(f"{url}/v1/completions", json=hog_body))
            deadline = time.monotonic() + 60.0
            full = min(args.max_batch_size, args.hog_prompts * args.hog_n)
            while await metric(session, url, "vllm:num_requests_running") < full:
                assert time.monotonic() < deadline and not hog.done(), "the hog never filled the batch"
                await asyncio.sleep(0.01)
            alone_tokens, alone_started = await tokens_generated(session, url), time.perf_counter()
            await asyncio.sleep(1.0)
            alone_rate = (await tokens_generated(session, url) - alone_tokens) / (
                time.perf_counter() - alone_started
            )
            behind_tokens, behind_started = await tokens_generated(session, url), time.perf_counter()
            behind, behind_steps = await short_requests(session, url, args.requests, args.short_tokens)
            short_tokens = len(behind) * args.short_tokens
            behind_rate = (await tokens_generated(session, url) - behind_tokens - short_tokens) / (
                time.perf_counter() - behind_started
            )
            hog_running_after = not hog.done()
            hog.cancel()  # the client leaves: the server aborts the hog's sequences
            with contextlib.suppress(asyncio.CancelledError):
                await hog
            oversized_line = None
            if not args.no_oversized:
                started = time.perf_counter()
                oversized = {"prompt": [[5]] * 10_000, "n": 64, "max_tokens": 1}
                async with session.post(f"{url}/v1/completions", json=oversized) as response:
                    answer = await response.json()
                    oversized_line = {
                        "status": response.status,
                        "code": answer.get("error", {}).get("code"),
                        "answered_ms": round((time.perf_counter() - started) * 1000, 2),
                    }
    finally:
        server.terminate()
        await server.wait()
    return {
        "idle": idle,
        "idle_steps": idle_steps,
        "behind": behind,
        "behind_steps": behind_steps,
        "hog_running_after": hog_running_after,
        "hog_alone_tokens_per_s": alone_rate,
        "hog_behind_tokens_per_s": behind_rate,
        "oversized": oversized_line,
    }


async def main(args: argparse.Namespace) -> None:
    shares = [None if text == "none" else float(text) for text in args.shares.split(",")]
    for share in shares:
        result = await one_policy(args, share)
        idle_summary, behind_summary = summary(result["idle"]), summary(result["behind"])
        common = {
            "benchmark": "fair_scheduling",
            "max_request_share": share,
            "short_tokens": args.short_tokens,
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        idle_line = {**common, "measurement": "short_latency_idle", **idle_summary}
        idle_line["engine_steps_p50"] = statistics.median(result["idle_steps"])
        print(json.dumps(idle_line), flush=True)
        print(
            json.dumps(
                {
                    **common,
                    "measurement": "short_latency_behind_hog",
                    "hog": f"{args.hog_prompts} prompts x n={args.hog_n} x {args.hog_tokens} tokens",
                    "max_batch_size": args.max_batch_size,
                    **behind_summary,
                    "engine_steps_p50": statistics.median(result["behind_steps"]),
                    "hog_still_running_after": result["hog_running_after"],
                }
            ),
            flush=True,
        )
        print(
            json.dumps(
                {
                    **common,
                    "measurement": "short_latency_ratio",
                    "p50_ratio_behind_hog_vs_idle": round(
                        behind_summary["p50_ms"] / idle_summary["p50_ms"], 2
                    ),
                    "mean_ratio_behind_hog_vs_idle": round(
                        behind_summary["mean_ms"] / idle_summary["mean_ms"], 2
                    ),
                    "steps_ratio_behind_hog_vs_idle": round(
                        statistics.median(result["behind_steps"])
                        / max(1, statistics.median(result["idle_steps"])),
                        2,
                    ),
                    "target_ratio": 2.0,
                }
            ),
            flush=True,
        )
        # What the short requests cost the hog: its token rate while they ran, against its rate alone.
        alone, behind = result["hog_alone_tokens_per_s"], result["hog_behind_tokens_per_s"]
        print(
            json.dumps(
                {
                    **common,
                    "measurement": "hog_throughput",
                    "alone_tokens_per_s": round(alone, 1),
                    "with_short_requests_tokens_per_s": round(behind, 1),
                    "ratio": round(behind / alone, 3) if alone else None,
                }
            ),
            flush=True,
        )
        if result["oversized"] is not None:
            print(
                json.dumps(
                    {**common, "measurement": "oversized_request", "request": "10000 prompts x n=64",
                     **result["oversized"]}
                ),
                flush=True,
            )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="short requests per phase (default 20)")
    parser.add_argument("--short-tokens", type=int, default=4, help="tokens per short request (default 4)")
    parser.add_argument("--hog-prompts", type=int, default=4, help="prompts of the hog request (default 4)")
    parser.add_argument("--hog-n", type=int, default=64, help="n of the hog request (default 64)")
    parser.add_argument("--hog-tokens", type=int, default=1000, help="max_tokens of the hog (default 1000)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="the server's slots (default 64)")
    parser.add_argument(
        "--shares",
        default="none,0.125",
        help="the servers' --max-request-share, one server each, comma-separated; 'none': off "
        "(default none,0.125: throughput first, then latency first)",
    )
    parser.add_argument(
        "--no-oversized",
        action="store_true",
        help="skip the oversized request (a server without request limits would queue all of it)",
    )
    asyncio.run(main(parser.parse_args()))
