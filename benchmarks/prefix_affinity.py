"""Prefix-cache hit rate with session affinity against session-blind routing, on a multi-turn load.

``--sessions`` concurrent sessions each run ``--turns`` turns through an ``InferenceRouter`` over 2 ``rollflow
serve`` servers. Every turn's prompt is the previous prompt, the previous completion and ``--user-tokens`` new
tokens, so a server that saw the previous turn can reuse its keys and values. Two runs of the same load:

- ``affinity``: requests carry the session id, so the router keeps each session on one server;
- ``no_session`` (the baseline): no session id, so the router sends each request to the least-loaded server,
  which spreads a session's turns over both servers much like round-robin.

The prefix caches are reset before each run; the hit rate is prompt tokens served from the cache over prompt
tokens looked up (the servers' ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``). One JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def scrape(session, urls: list[str]) -> tuple[float, float]:
    """Summed (hits, queries) prefix-cache token counters of ``urls``."""
    hits = queries = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run_load(client, args: argparse.Namespace, use_sessions: bool, seed: int) -> float:
    from rollflow.messages import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0)

    async def session(index: int) -> None:
        rng = random.Random(index)  # the same prompts in both runs
        history: list[int] = []
        for _ in range(args.turns):
            history += [rng.randrange(3, 200) for _ in range(args.user_tokens)]
            request = GenerateRequest(
                list(history), sampling, session_id=f"run{seed}-s{index}" if use_sessions else None
            )
            output = await client.generate(request)
            history += output.token_ids
        if use_sessions:
            await client.finish_session(f"run{seed}-s{index}")

    start = time.perf_counter()
    await asyncio.gather(*(session(index) for index in range(args.sessions)))
    return time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    import aiohttp

    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.inference.router import InferenceRouter
    from rollflow.launch.server_group import ServerGroup

    log_dir = tempfile.mkdtemp(prefix="rollflow-bench-")
    async with (
        ServerGroup("rollflow:tiny", 2, log_dir, startup_timeout_s=300) as group,
        InferenceRouter(group.urls, health_check_interval_s=30.0) as router,
        RemoteInferenceClient(router.url, group.urls) as client,
        aiohttp.ClientSession() as http,
    ):
        results = {}
        for seed, (name, use_sessions) in enumerate((("affinity", True), ("no_session", False)), start=1):
            await client.reset_prefix_cache()
            hits_before, queries_before = await scrape(http, group.urls)
            seconds = await run_load(client, args, use_sessions, seed)
            hits, queries = await scrape(http, group.urls)
            results[name] = ((hits - hits_before) / max(queries - queries_before, 1), seconds)
        print(
            json.dumps(
                {
                    "benchmark": "prefix_affinity",
                    "sessions": args.sessions,
                    "turns": args.turns,
                    "servers": 2,
                    "affinity_hit_rate": round(results["affinity"][0], 4),
                    "no_session_hit_rate": round(results["no_session"][0], 4),
                    "affinity_seconds": round(results["affinity"][1], 3),
                    "no_session_seconds": round(results["no_session"][1], 3),
                    "unit": "prompt tokens served from the prefix cache / prompt tokens looked up",
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
