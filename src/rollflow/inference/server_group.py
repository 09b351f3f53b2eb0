"""``ServerGroup``: N inference servers as local subprocesses, started together and never left behind.

Each server runs in its own process group with its output in ``{log_dir}/server-{i}.log``. rollflow's torch
engine server (``rollflow serve --port 0``) prints a JSON ready line ``{"event": "ready", "url": …}`` on
stdout once it listens; a vLLM server gets a free port picked here and is ready when ``GET /health`` answers
200. Teardown (on exit, exception, cancellation or Ctrl-C) sends SIGTERM to each process group, then SIGKILL
after ``stop_grace_s``. On Linux each server also gets SIGTERM from the kernel if this process dies without
cleaning up (``PR_SET_PDEATHSIG``), so even ``kill -9`` of the trainer leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Self

import aiohttp
import anyio
import structlog

from rollflow.errors import RollflowError

log = structlog.get_logger(__name__)

EngineKind = Literal["torch", "vllm"]
_PR_SET_PDEATHSIG = 1


class ServerStartError(RollflowError):
    """An inference server (or the router) exited or did not become ready in time; the message quotes its
    log's tail."""


def http_limit_flags(limits: Any) -> list[str]:
    """The ``--http-*`` flags of ``rollflow serve`` and ``rollflow router`` for an ``HttpLimits``."""
    return [
        "--http-header-timeout-s",
        repr(limits.header_timeout_s),
        "--http-body-timeout-s",
        repr(limits.body_timeout_s),
        "--http-max-connections",
        str(limits.max_connections),
    ]


def build_torch_server_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    return_routed_experts: bool = False,
    http_limits: Any = None,
    device: str = "auto",
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """Command line of one rollflow torch engine server (``python -m rollflow serve``); ``http_limits``
    (``HttpLimits``) become its ``--http-*`` flags, ``extra_args`` (``inference.server_args``) go last.

    Returns:
        ``(argv, env)``: ``env`` holds only the variables to add to the parent's environment. The API key
        travels there (``ROLLFLOW_API_KEY``), not on the command line, where ``ps`` would show it.

    Raises:
        ValueError: options the torch engine cannot honour: ``tensor_parallel_size`` above 1 (it runs on one
            device), a ``dtype`` other than auto or float32 (it computes in float32).
    """
    if tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size = {tensor_parallel_size}: rollflow's torch engine runs each server on one "
            "device; use vLLM (inference.engine = 'vllm') for tensor parallelism, or more servers"
        )
    if dtype not in ("auto", "float32"):
        raise ValueError(
            f"dtype = {dtype!r}: rollflow's torch engine computes in float32; use 'auto' or 'float32', or vLLM"
        )
    command = [
        sys.executable,
        "-m",
        "rollflow",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if max_batch_size is not None:
        command += ["--max-batch-size", str(max_batch_size)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    if return_routed_experts:
        command.append("--enable-return-routed-experts")
    if http_limits is not None:
        command += http_limit_flags(http_limits)
    if device != "auto":
        command += ["--device", device]
    env = {} if api_key is None else {"ROLLFLOW_API_KEY": api_key}
    return [*command, *extra_args], env


def build_vllm_server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    colocate: bool = False,
    weight_transfer_backend: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str = "auto",
    api_key: str | None = None,
    return_routed_experts: bool = False,
    device: str = "auto",
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` command line and the environment it needs, for a vLLM 0.33 RL server.

    ``tensor_parallel_size``, ``gpu_memory_utilization`` and ``dtype`` (``auto``: vLLM's own choice, no flag)
    become their flags; ``extra_args`` (``inference.server_args``) go last.

    - ``VLLM_SERVER_DEV_MODE=1`` registers the control plane (pause, sleep, weight transfer, world size).
    - ``--enable-scale-out`` registers ``/inference/v1/generate`` (off by default in 0.33).
    - ``--weight-transfer-config``: ``ipc`` when colocated (CUDA IPC handles, which also needs
      ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), else ``nccl``, unless ``weight_transfer_backend`` says otherwise.
    - ``--enable-sleep-mode`` when colocated, so the trainer can take the GPU memory back between rollouts.
    - ``--enable-return-routed-experts`` with ``return_routed_experts`` (MoE routing replay).
    - ``--logprobs-mode processed_logprobs``: logprobs after temperature and top-k/top-p, what the trainer
      recomputes (vLLM's default, ``raw_logprobs``, is before both; ``rollflow.inference.logprob_check``).

    Returns:
        ``(argv, env)``: ``env`` holds only the variables to add to the parent's environment.
    """
    backend = weight_transfer_backend or ("ipc" if colocate else "nccl")
    command = [
        "vllm",
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name or model,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--data-parallel-size",
        str(data_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        "--enable-scale-out",
    ]
    command += ["--logprobs-mode", "processed_logprobs"]
    if colocate:
        command.append("--enable-sleep-mode")
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if dtype != "auto":
        command += ["--dtype", dtype]
    if return_routed_experts:
        command.append("--enable-return-routed-experts")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key  # not ``--api-key``: the command line is visible to every user
    if backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return [*command, *extra_args], env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS's pick). Racy by nature; only for servers that cannot
    bind port 0 and report it (vLLM)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _prepare_child(parent_pid: int, niceness: int) -> None:
    """Runs in the child between fork and exec: lower its priority by ``niceness`` (every thread it starts
    inherits it), and ask the kernel for SIGTERM when the parent dies."""
    if niceness:
        os.nice(niceness)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


class _Server:
    __slots__ = ("index", "log_file", "log_path", "process", "pump", "url")

    def __init__(self, index: int, log_path: Path):
        self.index = index
        self.log_path = log_path
        self.log_file: IO[bytes] | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.pump: asyncio.Task[None] | None = None
        self.url: str | None = None


class ProcessGroup:
    """Local subprocesses started together and never left behind: each in its own process group, its output
    in ``{log_dir}/{kind}-{i}.log``, ready when it prints a JSON ready line (or, for a port chosen here, when
    ``GET /health`` answers 200). Subclasses say what to run (``_command``).

    Use ``async with`` (``.urls`` lists the processes' base URLs), or ``start``/``stop``.
    """

    kind = "process"

    def __init__(
        self,
        count: int,
        log_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        niceness: int = 0,
    ):
        if count < 1:
            raise ValueError(f"num_servers must be >= 1, got {count}")
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be within 0..19, got {niceness}")
        self.count = count
        self.niceness = niceness
        self.log_dir = Path(log_dir)
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(env or {})
        self._servers: list[_Server] = []

    def _command(self) -> tuple[list[str], dict[str, str], int | None]:
        """``(argv, env, port)`` of one process: ``env`` is added to this process's environment; ``port`` is
        None when the process prints its own ready line, else the port to poll ``/health`` on."""
        raise NotImplementedError

    def _process_env(self, index: int) -> dict[str, str]:
        """Variables of process ``index`` alone (e.g. its GPUs), over ``env``."""
        return {}

    def _describe(self) -> str:
        return f"{self.count} {self.kind}(s)"

    @property
    def urls(self) -> list[str]:
        """Base URLs of the running processes, in start order."""
        return [server.url for server in self._servers if server.url is not None]

    @property
    def pids(self) -> list[int]:
        """Process ids of the processes (each leads its own process group)."""
        return [server.process.pid for server in self._servers if server.process is not None]

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop_shielded()

    async def start(self) -> list[str]:
        """Start every server and wait until all are ready; returns their URLs.

        On any failure (a server exits, ``startup_timeout_s`` passes, cancellation) the servers already
        started are stopped before the error propagates.

        Raises:
            ServerStartError: a server exited before it was ready, or the group was not ready in time.
            MissingExtraError: ``engine = "vllm"`` without the ``vllm`` command installed.
        """
        if self._servers:
            raise RuntimeError("ServerGroup.start called twice")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._servers = [_Server(i, self.log_dir / f"{self.kind}-{i}.log") for i in range(self.count)]
        try:
            async with asyncio.timeout(self.startup_timeout_s):
                await asyncio.gather(*(self._start_one(server) for server in self._servers))
        except TimeoutError:
            await self._stop_shielded()
            raise ServerStartError(
                f"{self._describe()} not ready within startup_timeout_s = "
                f"{self.startup_timeout_s} s; logs in {self.log_dir}"
                + "".join(self._log_tail(server) for server in self._servers if server.url is None)
            ) from None
        except BaseException:
            await self._stop_shielded()
            raise
        log.info(f"{self.kind}s ready", what=self._describe(), urls=self.urls, log_dir=str(self.log_dir))
        return self.urls

    async def _start_one(self, server: _Server) -> None:
        command, process_env, port = self._command()
        env = {**os.environ, **self.env, **self._process_env(server.index), **process_env}
        server.log_file = open(server.log_path, "ab")  # noqa: SIM115 - closed in stop()
        server.log_file.write(f"$ {' '.join(command)}\n".encode())
        server.log_file.flush()
        server.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=server.log_file,
            env=env,
            start_new_session=True,  # its own process group: teardown signals the server and its children
            preexec_fn=functools.partial(_prepare_child, os.getpid(), self.niceness),
        )
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        server.pump = asyncio.create_task(self._pump_stdout(server, ready))
        if port is None:
            wait_exit = asyncio.ensure_future(server.process.wait())
            done, _ = await asyncio.wait({ready, wait_exit}, return_when=asyncio.FIRST_COMPLETED)
            wait_exit.cancel()
            if ready not in done:
                raise ServerStartError(
                    f"{self.kind} {server.index} exited with code {server.process.returncode} before it was ready"
                    + self._log_tail(server)
                )
            server.url = ready.result()
        else:
            await self._wait_healthy(server, f"http://{self.host}:{port}")
            server.url = f"http://{self.host}:{port}"

    async def _pump_stdout(self, server: _Server, ready: asyncio.Future[str]) -> None:
        """Copy the server's stdout to its log, resolving ``ready`` on the first ready line."""
        assert server.process is not None and server.process.stdout is not None
        while line := await server.process.stdout.readline():
            if server.log_file is not None and not server.log_file.closed:
                server.log_file.write(line)
                server.log_file.flush()
            if not ready.done() and line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "ready" and event.get("url"):
                        ready.set_result(str(event["url"]).rstrip("/"))

    async def _wait_healthy(self, server: _Server, url: str) -> None:
        assert server.process is not None
        async with aiohttp.ClientSession() as session:
            while True:
                if server.process.returncode is not None:
                    raise ServerStartError(
                        f"{self.kind} {server.index} exited with code {server.process.returncode} before it "
                        "was ready" + self._log_tail(server)
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(
                        f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)
                    ) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.5)

    def _log_tail(self, server: _Server, lines: int = 20) -> str:
        try:
            tail = server.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {server.log_path} ---\n" + "\n".join(tail)

    async def _stop_shielded(self) -> None:
        # Shielded: teardown must finish even when the caller is being cancelled (Ctrl-C).
        with anyio.CancelScope(shield=True):
            await self.stop()

    async def stop(self) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after ``stop_grace_s``. Idempotent."""
        servers = [server for server in self._servers if server.process is not None]
        for server in servers:
            _signal_group(server.process, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.stop_grace_s
        for server in servers:
            process = server.process
            assert process is not None
            try:
                await asyncio.wait_for(process.wait(), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                log.warning(f"{self.kind} ignored SIGTERM; killing it", pid=process.pid, index=server.index)
            # SIGKILL the group even after a clean exit: children the server left behind die with it.
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await process.wait()
        for server in self._servers:
            if server.pump is not None:
                server.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await server.pump
            if server.log_file is not None:
                server.log_file.close()
        self._servers = []


class ServerGroup(ProcessGroup):
    """Starts ``num_servers`` inference servers as subprocesses and stops them all.

    Args:
        model: model path or name (``rollflow:tiny`` for the built-in tiny model).
        num_servers: servers to start.
        log_dir: each server's stdout and stderr go to ``{log_dir}/server-{i}.log``.
        engine: ``torch`` (``rollflow serve``) or ``vllm`` (``vllm serve``; needs ``rollflow[vllm]`` and GPUs).
        host: interface the servers bind.
        startup_timeout_s: longest the group may take to become ready.
        stop_grace_s: time between SIGTERM and SIGKILL at teardown.
        env: extra environment variables for every server.
        server_options: keyword arguments of ``build_torch_server_command`` or ``build_vllm_server_command``
            (e.g. ``max_model_len``, ``tensor_parallel_size``, ``colocate``), besides model, host and port.
        server_env: per-server variables, one mapping per server (``rollflow.inference.gpus.server_gpu_env``:
            each server's ``CUDA_VISIBLE_DEVICES``); empty: none.

    Use ``async with ServerGroup(...) as group:`` (``group.urls`` lists the servers), or ``start``/``stop``.
    """

    kind = "server"

    def __init__(
        self,
        model: str,
        num_servers: int,
        log_dir: str | os.PathLike[str],
        *,
        engine: EngineKind = "torch",
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        server_options: Mapping[str, Any] | None = None,
        server_env: Sequence[Mapping[str, str]] = (),
        niceness: int = 0,
    ):
        if engine not in ("torch", "vllm"):
            raise ValueError(f"engine must be 'torch' or 'vllm', got {engine!r}")
        if server_env and len(server_env) != num_servers:
            raise ValueError(f"server_env has {len(server_env)} entries for {num_servers} servers")
        super().__init__(
            num_servers,
            log_dir,
            host=host,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            env=env,
            niceness=niceness,
        )
        self.model = model
        self.num_servers = num_servers
        self.engine = engine
        self.server_options = dict(server_options or {})
        self.server_env = [dict(env) for env in server_env]

    def _process_env(self, index: int) -> dict[str, str]:
        return self.server_env[index] if self.server_env else {}

    def _describe(self) -> str:
        return f"{self.num_servers} {self.engine} server(s)"

    def _command(self) -> tuple[list[str], dict[str, str], int | None]:
        if self.engine == "torch":
            command, env = build_torch_server_command(
                self.model, host=self.host, port=0, **self.server_options
            )
            return command, env, None
        from shutil import which

        from rollflow.errors import MissingExtraError

        if which("vllm") is None:
            raise MissingExtraError(
                "inference.engine = 'vllm' needs vLLM: pip install 'rollflow[vllm]' (on a GPU machine)"
            )
        port = free_port(self.host)
        command, env = build_vllm_server_command(self.model, host=self.host, port=port, **self.server_options)
        return command, env, port


def _signal_group(process: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
