"""Routers side by side: direct to the servers, rollflow's router, and vllm-router (when installed).

Two ``rollflow serve`` servers of the tiny model; each path gets the same load: ``--concurrency`` sessions
(each its own ``X-Session-ID``) sending 1-token ``/inference/v1/generate`` requests back to back, closed loop,
``--requests`` in all per run. Direct runs send session ``i`` to server ``i % 2``. rollflow's router runs as
``rollflow router`` and vllm-router as ``vllm-router --policy consistent_hash`` (which reads the same
``X-Session-ID`` header), each in its own process, as deployed; ``rollflow-managed-vllm-router`` is vllm-router
as rollflow starts it for ``inference.router_impl = "vllm-router"`` (``VllmRouterProcess``). The paths alternate within every repeat (the
order rotates per repeat), so each sees the same noisy machine; the load generator is this process.

Prints one JSON line per (path, concurrency): requests/s (median over ``--repeats`` runs, with min and max),
the ratio to direct (median of the per-repeat ratios), p50 and p99 latency (over every request of every
repeat), the router process's CPU per request (``router_cpu_us_per_request``, from ``/proc``: less noisy than
rates on a shared machine), the two servers' CPU per request (``servers_cpu_us_per_request``: a path that
fragments their batches costs them more per request) and the machine's load average before and after. rollflow's lines add
``sessions_per_server``: the sessions its router pinned to each server after the runs (``/list_workers``), how
evenly its placement (consistent hashing with bounded loads) split them. ``--balance-factor F`` (repeatable)
adds a path ``rollflow-balance-F``: rollflow's router started with ``--balance-factor F`` (1e9: plain
consistent hashing), to compare placements in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time the processes ``pids`` (all their threads) have used so far (Linux)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def run_load(
    session, urls: list[str], body: bytes, concurrency: int, requests: int
) -> tuple[float, list[float], int]:
    """``concurrency`` sessions send ``requests`` requests in all, each one after its previous answer;
    session ``i`` goes to ``urls[i % len(urls)]``. Returns (requests/s, latencies, errors)."""
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def one_session(index: int) -> None:
        nonlocal remaining, errors
        url = f"{urls[index % len(urls)]}/inference/v1/generate"
        headers = {"Content-Type": "application/json", "X-Session-ID": f"bench-{index}"}
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                errors += response.status != 200
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one_session(index) for index in range(concurrency)))
    return len(latencies) / (time.perf_counter() - start), latencies, errors


async def wait_ready(session, url: str, process: asyncio.subprocess.Process, timeout_s: float = 60.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"{url}: the router exited with status {process.returncode}")
        try:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}: the router was not healthy within {timeout_s} s")


async def start_rollflow_router(
    urls: list[str], balance_factor: float | None = None
) -> tuple[str, asyncio.subprocess.Process]:
    extra = [] if balance_factor is None else ["--balance-factor", str(balance_factor)]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollflow", "router", "--port", "0", "--health-check-interval-s", "5", *extra,
        *(arg for url in urls for arg in ("--server", url)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    while not (line := await process.stdout.readline()).startswith(b'{"event": "ready"'):
        if not line:
            raise RuntimeError("rollflow router exited before it was ready")
    return json.loads(line)["url"], process


async def sessions_per_server(session, router_url: str) -> list[int]:
    """How many sessions rollflow's router pinned to each server (``/list_workers``), in server order."""
    async with session.get(f"{router_url}/list_workers") as response:
        return [row["sessions"] for row in (await response.json())["workers"]]


async def start_vllm_router(binary: str, urls: list[str]) -> tuple[str, asyncio.subprocess.Process]:
    port = free_port()
    # RUST_LOG=warn: at its default level vllm-router logs every routing decision, which would cost it CPU.
    process = await asyncio.create_subprocess_exec(
        binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
        "--log-level", "warning", "--worker-urls", *urls, "--prometheus-port", str(free_port()),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
    )  # fmt: skip
    return f"http://127.0.0.1:{port}", process


async def main(args: argparse.Namespace) -> None:
    import aiohttp

    from rollflow.launch.router_process import VllmRouterProcess
    from rollflow.launch.server_group import ServerGroup

    vllm_router = shutil.which("vllm-router") or shutil.which(
        "vllm-router", path=os.path.dirname(sys.executable)
    )
    log_dir = tempfile.mkdtemp(prefix="rollflow-bench-")
    options = {"max_batch_size": args.max_batch_size}
    body = json.dumps(
        {"token_ids": list(range(5, 5 + args.prompt_tokens)), "sampling_params": {"max_tokens": 1}}
    ).encode()
    processes: list[asyncio.subprocess.Process] = []
    async with (
        ServerGroup("rollflow:tiny", 2, log_dir, startup_timeout_s=300, server_options=options) as group,
        contextlib.AsyncExitStack() as stack,
    ):
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                paths: dict[str, list[str]] = {"direct": list(group.urls)}
                router_pids: dict[str, list[int]] = {"direct": []}  # whose CPU a path adds
                url, process = await start_rollflow_router(group.urls)
                processes.append(process)
                paths["rollflow"] = [url]
                router_pids["rollflow"] = [process.pid]
                for factor in args.balance_factor:
                    url, process = await start_rollflow_router(group.urls, factor)
                    processes.append(process)
                    paths[f"rollflow-balance-{factor:g}"] = [url]
                    router_pids[f"rollflow-balance-{factor:g}"] = [process.pid]
                if vllm_router and not args.no_vllm_router:
                    url, process = await start_vllm_router(vllm_router, group.urls)
                    processes.append(process)
                    await wait_ready(session, url, process)
                    paths["vllm-router"] = [url]
                    router_pids["vllm-router"] = [process.pid]
                    # The same router as rollflow starts it (inference.router_impl = "vllm-router").
                    managed = VllmRouterProcess(group.urls, log_dir, health_check_interval_s=5.0)
                    await stack.enter_async_context(managed)
                    paths["rollflow-managed-vllm-router"] = [managed.url]
                    router_pids["rollflow-managed-vllm-router"] = list(managed.pids)
                else:
                    print(json.dumps({"benchmark": "router_compare", "note": "vllm-router not installed"}))
                for concurrency in args.concurrency:
                    for urls in paths.values():  # warm-up: connections, first forwards
                        await run_load(session, urls, body, concurrency, concurrency * 2)
                    load_before = load_average()
                    runs: dict[str, list[tuple[float, list[float], int]]] = {name: [] for name in paths}
                    router_cpu_s = dict.fromkeys(paths, 0.0)
                    servers_cpu_s = dict.fromkeys(paths, 0.0)
                    names = list(paths)
                    for repeat in range(args.repeats):
                        shift = repeat % len(names)
                        for name in names[shift:] + names[:shift]:
                            cpu_before = cpu_seconds(router_pids[name])
                            servers_before = cpu_seconds(group.pids)
                            runs[name].append(
                                await run_load(session, paths[name], body, concurrency, args.requests)
                            )
                            router_cpu_s[name] += cpu_seconds(router_pids[name]) - cpu_before
                            servers_cpu_s[name] += cpu_seconds(group.pids) - servers_before
                    load_after = load_average()
                    direct_rates = [rate for rate, _, _ in runs["direct"]]
                    for name, results in runs.items():
                        rates = [rate for rate, _, _ in results]
                        latencies = [value for _, values, _ in results for value in values]
                        ratios = [rate / base for rate, base in zip(rates, direct_rates, strict=True)]
                        line = {
                            "benchmark": "router_compare",
                            "path": name,
                            "concurrency": concurrency,
                            "requests_per_s": round(statistics.median(rates), 1),
                            "requests_per_s_min": round(min(rates), 1),
                            "requests_per_s_max": round(max(rates), 1),
                            "ratio_vs_direct": round(statistics.median(ratios), 3),
                            "p50_ms": round(percentile(latencies, 0.5) * 1e3, 2),
                            "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
                            "errors": sum(errors for _, _, errors in results),
                            # The router process's CPU per request (0 for direct): what it takes from engines.
                            "router_cpu_us_per_request": round(
                                router_cpu_s[name] / (args.repeats * args.requests) * 1e6, 1
                            ),
                            "servers_cpu_us_per_request": round(
                                servers_cpu_s[name] / (args.repeats * args.requests) * 1e6, 1
                            ),
                            "repeats": args.repeats,
                            "requests_per_run": args.requests,
                            "load_avg_before": load_before,
                            "load_avg_after": load_after,
                            "cpus": os.cpu_count(),
                        }
                        if name.startswith("rollflow") and "vllm" not in name:
                            line["sessions_per_server"] = await sessions_per_server(session, paths[name][0])
                        print(json.dumps(line), flush=True)
            finally:
                for process in processes:
                    if process.returncode is None:
                        process.terminate()
                        await process.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    # Runs of about 2 s each, five per path: shorter ones (3,000 requests) read +-20% apart on a shared machine.
    parser.add_argument("--requests", type=int, default=10_000, help="requests per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--no-vllm-router", action="store_true", help="skip vllm-router even if installed")
    parser.add_argument(
        "--balance-factor",
        type=float,
        action="append",
        default=[],
        help="also run rollflow's router with this --balance-factor (repeatable; 1e9: plain consistent hashing)",
    )
    asyncio.run(main(parser.parse_args()))
