"""``LocalProcesses``: children of this process started together and never left behind.

The local backend of the launch layer: the engine servers (``rollflow.launch.server_group.ServerGroup``)
and the router (``rollflow.launch.router_process.RouterProcess``) are kinds of it, and so are the servers
a Ray server launcher runs on its node (``rollflow.launch.ray_servers``). Each child runs in its own process
group with its output in ``{log_dir}/{kind}-{i}.log`` and is ready when it prints a JSON ready line
``{"event": "ready", "url": …}`` (or, for a port chosen here, when ``GET /health`` answers 200). Teardown (on
exit, exception, cancellation or Ctrl-C) sends SIGTERM to each process group, then SIGKILL after
``stop_grace_s``. Each is started through ``rollflow.processes``, so it also gets SIGTERM from the kernel if its
parent dies without cleaning up (``PR_SET_PDEATHSIG``): even ``kill -9`` of the trainer leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import aiohttp
import anyio
import structlog

from rollflow.errors import RollflowError, ServerDiedError
from rollflow.processes import CommandChild, start_command

log = structlog.get_logger(__name__)


class ServerStartError(RollflowError):
    """An inference server (or the router) exited or did not become ready in time; the message quotes its
    log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS's pick). Racy by nature; only for servers that cannot
    bind port 0 and report it (vLLM)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _has_exited(pid: int) -> bool:
    """Whether child ``pid`` has exited or is exiting, reaped or not (``WNOWAIT``: its status stays for the
    watcher). Exiting: a killed process whose main thread is a zombie while its other threads still tear down
    (a big server's take a while on a busy machine) cannot be waited for yet, but is dead all the same."""
    try:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
    except ChildProcessError:  # reaped already
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (not Linux): waitid's answer stands
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


class _Child:
    __slots__ = ("child", "index", "log_path", "pump", "url")

    def __init__(self, index: int, log_path: Path):
        self.index = index
        self.log_path = log_path
        self.child: CommandChild | None = None
        self.pump: asyncio.Task[None] | None = None
        self.url: str | None = None


class LocalProcesses:
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
        process_env: Sequence[Mapping[str, str]] | None = None,
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
        # Per child (e.g. each server's CUDA_VISIBLE_DEVICES), over ``env``.
        self.process_env = [dict(extra) for extra in process_env] if process_env is not None else None
        if self.process_env is not None and len(self.process_env) != count:
            raise ValueError(f"process_env has {len(self.process_env)} entries for {count} processes")
        self._servers: list[_Child] = []

    def _command(self, index: int) -> tuple[list[str], dict[str, str], int | None]:
        """``(argv, env, port)`` of process ``index``: ``env`` is added to this process's environment; ``port`` is
        None when the process prints its own ready line, else the port to poll ``/health`` on."""
        raise NotImplementedError

    def _describe(self) -> str:
        return f"{self.count} {self.kind}(s)"

    @property
    def urls(self) -> list[str]:
        """Base URLs of the running processes, in start order."""
        return [server.url for server in self._servers if server.url is not None]

    @property
    def pids(self) -> list[int]:
        """Process ids of the processes (each leads its own process group)."""
        return [server.child.pid for server in self._servers if server.child is not None]

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Stop every process. When the body failed and some of them had died by themselves, raise
        ``ServerDiedError`` naming them (the body's error is its cause): otherwise a call that failed because
        its server died would read as the call's own failure."""
        # Read before the teardown, which ends them all.
        deaths = await self.deaths() if isinstance(exc, Exception) else []
        await self._stop_shielded()
        if deaths:
            raise ServerDiedError(
                f"{len(deaths)} of {self._describe()} died while in use:\n"
                + "\n".join(deaths)
                + f"\nthe call that failed: {type(exc).__name__}: {exc}",
                deaths,
            ) from exc

    async def deaths(self) -> list[str]:
        """One text per process that has exited by itself (none is stopped here): its kind, index and URL,
        pid, exit code or signal, and its log's path with the log's last lines."""
        found = []
        for server in self._servers:
            child = server.child
            if child is None:
                continue
            code = child.returncode
            if code is None:
                if not _has_exited(child.pid):
                    continue
                # Exited but not reaped yet: the event loop's child watcher reaps it once its last thread
                # is gone.
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(child.wait(), 30)
            if code is None:
                how = "exited (its exit status not known yet: it is still tearing down)"
            elif code < 0:
                how = f"was killed by {_signal_name(-code)}"
            else:
                how = f"exited with code {code}"
            found.append(
                f"{self.kind} {server.index} ({server.url or 'not ready yet'}, pid {child.pid}) {how}; "
                f"log {server.log_path}" + self._log_tail(server)
            )
        return found

    async def start(self) -> list[str]:
        """Start every server and wait until all are ready; returns their URLs.

        On any failure (a server exits, ``startup_timeout_s`` passes, cancellation) the servers already
        started are stopped before the error propagates.

        Raises:
            ServerStartError: a server exited before it was ready, or the group was not ready in time.
            MissingExtraError: ``engine = "vllm"`` without the ``vllm`` command installed.
        """
        if self._servers:
            raise RuntimeError(f"{type(self).__name__}.start called twice")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._servers = [_Child(i, self.log_dir / f"{self.kind}-{i}.log") for i in range(self.count)]
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

    async def _start_one(self, server: _Child) -> None:
        command, process_env, port = self._command(server.index)
        own = self.process_env[server.index] if self.process_env is not None else {}
        env = {**os.environ, **self.env, **own, **process_env}
        # stdout is read for the ready line (and copied to the log); stderr goes straight to the log.
        server.child = await start_command(
            command,
            name=f"{self.kind}-{server.index}",
            env=env,
            log_path=server.log_path,
            stdout=asyncio.subprocess.PIPE,
            niceness=self.niceness,
        )
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        server.pump = asyncio.create_task(self._pump_stdout(server.child, ready))
        if port is None:
            wait_exit = asyncio.ensure_future(server.child.wait())
            done, _ = await asyncio.wait({ready, wait_exit}, return_when=asyncio.FIRST_COMPLETED)
            wait_exit.cancel()
            if ready not in done:
                raise ServerStartError(
                    f"{self.kind} {server.index} exited with code {server.child.returncode} before it was ready"
                    + self._log_tail(server)
                )
            server.url = ready.result()
        else:
            await self._wait_healthy(server, f"http://{self.host}:{port}")
            server.url = f"http://{self.host}:{port}"

    @staticmethod
    async def _pump_stdout(child: CommandChild, ready: asyncio.Future[str]) -> None:
        """Copy the server's stdout to its log, resolving ``ready`` on the first ready line."""
        assert child.process.stdout is not None and child.log_file is not None
        while line := await child.process.stdout.readline():
            if not child.log_file.closed:
                child.log_file.write(line)
                child.log_file.flush()
            if not ready.done() and line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "ready" and event.get("url"):
                        ready.set_result(str(event["url"]).rstrip("/"))

    async def _wait_healthy(self, server: _Child, url: str) -> None:
        assert server.child is not None
        async with aiohttp.ClientSession() as session:
            while True:
                if server.child.returncode is not None:
                    raise ServerStartError(
                        f"{self.kind} {server.index} exited with code {server.child.returncode} before it "
                        "was ready" + self._log_tail(server)
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(
                        f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)
                    ) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.5)

    def _log_tail(self, server: _Child, lines: int = 20) -> str:
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
        children = [server.child for server in self._servers if server.child is not None]
        for child in children:
            child.terminate()
        deadline = time.monotonic() + self.stop_grace_s
        # All were asked at once; each then gets what is left of the one deadline.
        await asyncio.gather(
            *(child.stop(deadline - time.monotonic(), terminate=False) for child in children)
        )
        for server in self._servers:
            if server.pump is not None:
                server.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await server.pump
        self._servers = []
