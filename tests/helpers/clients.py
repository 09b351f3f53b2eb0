"""The inference client under test, by ``ROLLFLOW_INFERENCE_MODE``: ``local`` (the default) drives an
in-process torch engine; ``http`` drives two real ``rollflow serve`` servers behind a ``rollflow router``
process, all on loopback. Tests that take the ``inference_client`` fixture run in either mode unchanged.

The engine or servers are shared by the whole session and are read-only by contract: after each test the
fixture checks that they are unpaused and still on the initial weights (policy version 0), and fails the
test that broke that (resuming them first, so the next test is unaffected). Tests that move weights start
their own engine or servers.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Protocol

import pytest

MODE_ENV = "ROLLFLOW_INFERENCE_MODE"
MODES = ("local", "http")


def suite_inference_mode() -> str:
    """The mode this test run follows: ``$ROLLFLOW_INFERENCE_MODE``, else ``local``."""
    mode = os.environ.get(MODE_ENV) or "local"
    if mode not in MODES:
        raise pytest.UsageError(f"{MODE_ENV}={mode!r} is not an inference mode: set it to 'local' or 'http'")
    return mode


class InferenceBackend(Protocol):
    """What a mode-following test may ask of the engines behind its client, besides the client itself."""

    mode: str

    def client(self) -> Any:
        """A new client for the current event loop (the caller closes it)."""
        ...

    async def running_requests(self) -> int:
        """Requests holding a KV-cache slot, over every engine."""
        ...

    async def prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens served from a prefix cache so far, over every engine."""
        ...

    async def check_untouched(self) -> str | None:
        """None if every engine is unpaused and on policy version 0; else what is wrong (after resuming)."""
        ...


class LocalBackend:
    """One in-process engine of the tiny model (engines serve any event loop), as long as the servers'
    (the model's 2048 positions): agent libraries' system prompts and tool schemas need the room."""

    mode = "local"

    def __init__(self, model_dir: Path):
        from rollflow.inference.engine.engine import TorchEngine
        from rollflow.models.loading import load_causal_lm

        self.engine = TorchEngine(load_causal_lm(model_dir), max_batch_size=16, max_model_len=2048)

    def client(self) -> Any:
        from rollflow.inference.client import LocalInferenceClient

        return LocalInferenceClient([self.engine])

    async def running_requests(self) -> int:
        return self.engine.num_running

    async def prefix_cache_hit_tokens(self) -> int:
        return self.engine.prefix_cache_hit_tokens

    async def check_untouched(self) -> str | None:
        problems = []
        if self.engine.is_paused:
            await self.engine.resume()
            problems.append("left the shared engine paused")
        if self.engine.policy_version != 0:
            problems.append(
                f"changed the shared engine's weights (policy version {self.engine.policy_version})"
            )
        return "; ".join(problems) or None

    def close(self) -> None:
        asyncio.run(self.engine.shutdown())


def _metric(text: str, name: str) -> float:
    """The value of the Prometheus sample ``name{labels} value`` in a server's ``/metrics`` text."""
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing from /metrics:\n{text}")


class HttpBackend:
    """The session's servers (``inference_servers``) behind a ``rollflow router`` process started on the
    servers' own background loop, so any test loop can use its URL."""

    mode = "http"

    def __init__(self, servers: Any, log_dir: Path):
        from rollflow.launch.router_process import RouterProcess

        self.servers = servers
        self.router = RouterProcess(servers.urls, log_dir, health_check_interval_s=0.5)
        servers.run(self.router.start())
        assert self.router.url is not None
        self.router_url = self.router.url

    def client(self) -> Any:
        from rollflow.inference.remote import RemoteInferenceClient

        return RemoteInferenceClient(
            self.router_url, self.servers.urls, control_timeout_s=60, request_timeout_s=120
        )

    async def _get_all(self, path: str) -> list[Any]:
        """``GET path`` on every server, each answer decoded (JSON) or as text."""
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            answers = []
            for url in self.servers.urls:
                async with http.get(f"{url}{path}") as response:
                    response.raise_for_status()
                    is_json = response.content_type == "application/json"
                    answers.append(await response.json() if is_json else await response.text())
            return answers

    async def running_requests(self) -> int:
        texts = await self._get_all("/metrics")
        return sum(int(_metric(text, "vllm:num_requests_running")) for text in texts)

    async def prefix_cache_hit_tokens(self) -> int:
        texts = await self._get_all("/metrics")
        return sum(int(_metric(text, "vllm:prefix_cache_hits_total")) for text in texts)

    async def check_untouched(self) -> str | None:
        problems = []
        if any(answer["is_paused"] for answer in await self._get_all("/is_paused")):
            client = self.client()
            try:
                await client.resume()
            finally:
                await client.close()
            problems.append("left the shared servers paused")
        versions = [int(_metric(text, "rollflow:policy_version")) for text in await self._get_all("/metrics")]
        if any(versions):
            problems.append(f"changed the shared servers' weights (policy versions {versions})")
        return "; ".join(problems) or None

    def close(self) -> None:
        self.servers.run(self.router.stop(), timeout_s=60)
