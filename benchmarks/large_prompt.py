"""Huge text prompts against ``rollflow serve``: does ``/health`` stay responsive, and does memory stay bounded?

One ``rollflow serve`` subprocess (tiny model, ``max_model_len`` 2048). ``/health`` is polled every 10 ms
throughout; the baseline is its latency on the idle server in the same run. Then, one at a time:

- ``huge``: a ``--huge-mb`` MB text prompt on ``/v1/completions``: refused (400) by its length before
  tokenizing; reports the reply time, the status, and ``/health``'s latency meanwhile.
- ``under_cap``: a text prompt just under the server's character cap (the longest it still tokenizes),
  tokenized in a worker thread: the same figures.

Also the server's resident memory (VmRSS) before and its peak (VmHWM) after. Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def memory_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def poll_health(session, url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        async with session.get(f"{url}/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)
    return latencies


async def while_polled(session, url: str, work) -> tuple[float, list[float], object]:
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_health(session, url, stop))
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    result = await work
    elapsed = time.perf_counter() - started
    stop.set()
    return elapsed, await poller, result


def completion_body(prompt: str) -> bytes:
    # Encoded before the health polls start: encoding 30 MB here would stall this process's own polls.
    return json.dumps({"prompt": prompt, "max_tokens": 1}).encode()


async def completion(session, url: str, body: bytes) -> tuple[int, str]:
    async with session.post(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        text = await response.text()
        return response.status, text


async def main(args: argparse.Namespace) -> None:
    import aiohttp

    from rollflow.inference.prompt_limits import max_prompt_chars
    from rollflow.models.loading import load_tokenizer, resolve_model_path

    cap = max_prompt_chars(2048, load_tokenizer(resolve_model_path("rollflow:tiny")))
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollflow", "serve", "--model", "rollflow:tiny", "--port", "0",
        "--max-model-len", "2048",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while not (line := await server.stdout.readline()).startswith(b'{"event": "ready"'):
            assert line, "rollflow serve exited before it was ready"
        url = json.loads(line)["url"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await completion(session, url, completion_body("warm up"))
            rss_before = memory_mb(server.pid, "VmRSS")
            _, idle, _ = await while_polled(session, url, asyncio.sleep(1.0))
            idle_max_ms = round(max(idle) * 1000, 2)
            cases = [
                ("huge", "hello world " * (args.huge_mb * 1_000_000 // 12)),
                ("under_cap", "hello world " * ((cap - 16) // 12)),
            ]
            for name, prompt in cases:
                body = completion_body(prompt)
                elapsed, health, (status, text) = await while_polled(
                    session, url, completion(session, url, body)
                )
                print(
                    json.dumps(
                        {
                            "benchmark": "large_prompt",
                            "measurement": name,
                            "prompt_chars": len(prompt),
                            "char_cap": cap,
                            "status": status,
                            "reply_s": round(elapsed, 3),
                            "health_max_ms": round(max(health) * 1000, 2),
                            "health_polls": len(health),
                            "idle_health_max_ms": idle_max_ms,
                            "error": json.loads(text)["error"]["message"][:120] if status >= 400 else None,
                        }
                    ),
                    flush=True,
                )
            print(
                json.dumps(
                    {
                        "benchmark": "large_prompt",
                        "measurement": "server_memory",
                        "rss_before_mb": round(rss_before, 1),
                        "rss_after_mb": round(memory_mb(server.pid, "VmRSS"), 1),
                        "rss_peak_mb": round(memory_mb(server.pid, "VmHWM"), 1),
                    }
                ),
                flush=True,
            )
    finally:
        server.terminate()
        await server.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--huge-mb", type=int, default=30, help="size of the huge prompt in MB (default 30)")
    asyncio.run(main(parser.parse_args()))
