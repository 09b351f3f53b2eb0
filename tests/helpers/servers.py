"""Real ``rollflow serve`` servers for tests, started once per session on a background event loop, and the
sum of one of their metrics.

Server start-up (torch import, model load) takes seconds, so the HTTP tests share one ServerGroup. It runs on
its own loop in a thread, so tests on any event loop (function- or module-scoped) can use its URLs.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp

from rollflow.launch.server_group import ServerGroup


async def server_metric(urls: list[str], name: str) -> float:
    """Sum of one metric over the servers' ``/metrics`` (``name{...}`` or ``name_total{...}`` samples), e.g.
    ``vllm:num_requests_running``: what a test waits on instead of guessing how long the servers take."""
    total = 0.0
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith(name + "{") or line.startswith(name + "_total{"):
                        total += float(line.rsplit(" ", 1)[1])
    return total


class BackgroundServerGroup:
    """A started ``ServerGroup`` owned by a private event loop thread; ``close()`` stops it."""

    def __init__(self, num_servers: int, log_dir: Path, **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-servers", daemon=True)
        self._thread.start()
        self.group = ServerGroup("rollflow:tiny", num_servers, log_dir, startup_timeout_s=180, **options)
        try:
            asyncio.run_coroutine_threadsafe(self.group.start(), self._loop).result()
        except BaseException:
            self._shutdown_loop()
            raise
        self.urls = self.group.urls
        self.pids = self.group.pids
        self.log_dir = log_dir

    def run(self, coroutine, timeout_s: float | None = None):
        """Run ``coroutine`` on the group's loop (for things that live next to the servers, like a router)
        and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout_s)

    def close(self) -> None:
        try:
            self.run(self.group.stop(), timeout_s=60)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
