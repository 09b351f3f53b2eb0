"""Slow clients against ``rollflow serve``: do stalled connections hurt everyone else, and are they closed?

One ``rollflow serve`` subprocess (tiny model) with ``--http-header-timeout-s`` and ``--http-body-timeout-s``
set to ``--timeout-s``. In one invocation:

1. ``legit_latency``: ``--requests`` generate requests (1 token, a new connection each, one at a time) on the
   idle server (the baseline), then again while ``--stalled`` connections hold the server, stalled in their
   request line, headers or body (a quarter each), then once more after they were closed. Reports p50 and
   p99 of each, and the stalled/idle p99 ratio (target: at most 2).
2. ``stalled_closed``: when the server closed the stalled connections, counted from each one's connect:
   the slowest minus ``--timeout-s`` is how late the deadline fired; also how many got the 408 reply.

The open-file limit of this process is raised to fit the connections. Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STALLS = (
    ("request_line", b"POST /inference/v1/gen"),
    ("headers", b"POST /inference/v1/generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"),
    ("body", b'POST /inference/v1/generate HTTP/1.1\r\nHost: bench\r\nContent-Length: 4096\r\n\r\n{"tok'),
    ("nothing", b""),
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def timed_requests(url: str, count: int) -> list[float]:
    import aiohttp

    body = json.dumps({"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 1}}).encode()
    latencies = []
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request: accept included
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(
                f"{url}/inference/v1/generate", data=body, headers={"Content-Type": "application/json"}
            ) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - started)
    return latencies


async def stall(port: int, payload: bytes) -> tuple[float, bytes]:
    """Open a connection, send ``payload`` and nothing more; (seconds until the server closed it, reply)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened = time.perf_counter()  # the server's deadline counts from its accept, just before this
    writer.write(payload)
    reply = await reader.read()
    closed = time.perf_counter() - opened
    writer.close()
    return closed, reply


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2),
    }


async def main(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = args.stalled + 256
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollflow", "serve", "--model", "rollflow:tiny", "--port", "0",
        "--http-header-timeout-s", str(args.timeout_s), "--http-body-timeout-s", str(args.timeout_s),
        "--http-max-connections", str(args.stalled + 256),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not (line := await server.stdout.readline()).startswith(b'{"event": "ready"'):
            assert line, "rollflow serve exited before it was ready"
        url = json.loads(line)["url"]
        port = int(url.rsplit(":", 1)[1])
        await timed_requests(url, 20)  # warm-up: first forward, thread start
        idle = await timed_requests(url, args.requests)

        opened_at = time.perf_counter()
        stalls = [
            asyncio.create_task(stall(port, STALLS[index % len(STALLS)][1])) for index in range(args.stalled)
        ]
        await asyncio.sleep(0.5)  # every connection open and stalled before measuring
        open_s = time.perf_counter() - opened_at
        stalled = await timed_requests(url, args.requests)
        measured_s = time.perf_counter() - opened_at
        results = await asyncio.gather(*stalls)
        after = await timed_requests(url, args.requests)

        idle_summary, stalled_summary = summary(idle), summary(stalled)
        print(
            json.dumps(
                {
                    "benchmark": "slow_clients",
                    "measurement": "legit_latency",
                    "requests": args.requests,
                    "stalled_connections": args.stalled,
                    "idle": idle_summary,
                    "while_stalled": stalled_summary,
                    "after_stalls_closed": summary(after),
                    "p99_ratio_stalled_vs_idle": round(stalled_summary["p99_ms"] / idle_summary["p99_ms"], 2),
                    "target_p99_ratio": 2.0,
                    # The stalled phase must end before the stalls time out, or it measured a freed server.
                    "measured_within_timeout": measured_s < args.timeout_s,
                    "stalls_opened_s": round(open_s, 2),
                }
            ),
            flush=True,
        )
        closed_after = [closed for closed, _ in results]
        replies_408 = sum(reply.startswith(b"HTTP/1.1 408") for _, reply in results)
        print(
            json.dumps(
                {
                    "benchmark": "slow_clients",
                    "measurement": "stalled_closed",
                    "stalled_connections": args.stalled,
                    "timeout_s": args.timeout_s,
                    "closed_after_s_min": round(min(closed_after), 3),
                    "closed_after_s_median": round(statistics.median(closed_after), 3),
                    "closed_after_s_max": round(max(closed_after), 3),
                    "slowest_past_timeout_s": round(max(closed_after) - args.timeout_s, 3),
                    "answered_408": replies_408,
                    "closed": len(results),
                }
            ),
            flush=True,
        )
    finally:
        server.terminate()
        await server.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stalled", type=int, default=1000, help="stalled connections (default 1000)")
    parser.add_argument("--requests", type=int, default=200, help="legit requests per phase (default 200)")
    parser.add_argument("--timeout-s", type=float, default=15.0, help="server read timeouts (default 15)")
    asyncio.run(main(parser.parse_args()))
