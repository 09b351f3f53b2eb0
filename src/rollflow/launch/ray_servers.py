"""Engine servers on Ray: one launcher actor per node runs that node's servers (``ServerLauncher``).

The launcher holds the node's server bundle (the GPUs of all its servers), splits the GPU ids Ray assigned
it into one tensor-parallel group per server (each server's own ``CUDA_VISIBLE_DEVICES``), and runs them as a
``ServerGroup`` of local subprocesses bound to the node's address, on an event loop thread that lives as long
as the actor's process: a server gets SIGTERM from the kernel when the launcher's process dies
(``PR_SET_PDEATHSIG``), so a killed actor or driver leaves no server behind. The router and the client reach the
servers by URL. Logs go to ``{log_dir}/node-{address}-{node id}/server-{i}.log`` on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import structlog

from rollflow.launch.plan import ServerSlot

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 30.0


class ServerLauncher:
    """A node's servers, as a Ray actor (wrapped with ``ray.remote`` where it is started)."""

    def __init__(
        self,
        model: str,
        slots: list[ServerSlot],
        log_dir: str,
        options: dict[str, Any],
        shared_gpus: list[list[str]] | None = None,
    ):
        self.model = model
        self.slots = slots
        # Colocated: each server's GPUs are those Ray gave the trainer ranks it shares (its bundle has none).
        self.shared_gpus = shared_gpus
        self.log_dir = log_dir
        self.options = options
        self.group: Any = None
        self.process_env: list[dict[str, str]] = []
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="rollflow-servers", daemon=True).start()

    def start(self) -> list[str]:
        """Start the node's servers; their URLs in slot order."""
        import ray

        from rollflow.launch.server_group import ServerGroup

        address = ray.util.get_node_ip_address()
        gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
        self.process_env = []
        for position, slot in enumerate(self.slots):
            if self.shared_gpus is not None:
                share = self.shared_gpus[position]
            else:
                share = gpu_ids[position * slot.gpus : (position + 1) * slot.gpus] if slot.gpus else []
            # No GPUs: none visible, so a torch engine on "auto" takes the CPU it was planned for.
            self.process_env.append({"CUDA_VISIBLE_DEVICES": ",".join(share)})
        node_id = ray.get_runtime_context().get_node_id()
        log_dir = Path(self.log_dir) / f"node-{address}-{node_id[:8]}"
        self.group = ServerGroup(
            self.model, len(self.slots), log_dir, host=address, process_env=self.process_env, **self.options
        )
        return asyncio.run_coroutine_threadsafe(self.group.start(), self._loop).result()

    def info(self) -> dict[str, Any]:
        """Where the servers run: node, the launcher's pid, server pids and their ``CUDA_VISIBLE_DEVICES``."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "indices": [slot.index for slot in self.slots],
            "server_pids": self.group.pids if self.group is not None else [],
            "process_env": self.process_env,
        }

    def stop(self) -> None:
        if self.group is not None:
            asyncio.run_coroutine_threadsafe(self.group.stop(), self._loop).result(STOP_TIMEOUT_S)


class RayServers:
    """The servers of a placement plan, one ``ServerLauncher`` per node; ``urls`` in server index order."""

    def __init__(self, ray: Any, launchers: dict[str, Any]):
        self._ray = ray
        self.launchers = launchers
        self.urls: list[str] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def run(
        cls,
        ray: Any,
        model: str,
        slots_by_node: dict[str, list[ServerSlot]],
        placement_groups: dict[str, Any],
        log_dir: Path,
        env: dict[str, str],
        startup_timeout_s: float,
        options: dict[str, Any],
        rank_gpus: list[list[str]] | None = None,
    ) -> AsyncIterator[RayServers]:
        """Start every node's launcher and servers; stop and end them all on exit (error and cancellation
        included).

        ``rank_gpus`` (each trainer rank's GPU ids) gives colocated servers the GPUs of the ranks they share.

        Raises:
            ServerStartError: a server did not become ready within ``startup_timeout_s`` (or exited).
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rollflow.launch.local import ServerStartError

        actor_class = ray.remote(ServerLauncher)
        launchers = {}
        for node_id, slots in slots_by_node.items():
            shared = None
            if rank_gpus is not None and any(slot.worker_ranks for slot in slots):
                shared = [[gpu for rank in slot.worker_ranks for gpu in rank_gpus[rank]] for slot in slots]
            launchers[node_id] = actor_class.options(
                num_cpus=sum(slot.bundle.cpus for slot in slots),
                num_gpus=sum(slot.bundle.gpus for slot in slots),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_groups[node_id], placement_group_bundle_index=0
                ),
                runtime_env={"env_vars": env},
                max_restarts=0,
                max_concurrency=4,  # info() while start() runs
            ).remote(
                model,
                slots,
                str(log_dir.resolve()),
                {**options, "startup_timeout_s": startup_timeout_s},
                shared,
            )
        servers = cls(ray, launchers)
        try:
            order = list(launchers)
            started = [asyncio.wrap_future(launchers[node].start.remote().future()) for node in order]
            try:
                # The group's own timeout fires first; this one also covers an actor that never starts.
                results = await asyncio.wait_for(asyncio.gather(*started), startup_timeout_s + 30)
            except TimeoutError:
                raise ServerStartError(
                    f"the servers on Ray were not ready within inference.startup_timeout_s = {startup_timeout_s} s"
                ) from None
            except ray.exceptions.RayTaskError as error:
                raise error.cause if isinstance(error.cause, BaseException) else error from None
            by_index = {}
            for node, urls in zip(order, results, strict=True):
                for slot, url in zip(slots_by_node[node], urls, strict=True):
                    by_index[slot.index] = url
            servers.urls = [by_index[index] for index in sorted(by_index)]
            log.info("servers ready on Ray", urls=servers.urls)
            yield servers
        finally:
            with anyio.CancelScope(shield=True):  # teardown finishes even when the run is cancelled (Ctrl-C)
                await servers._stop()

    async def info(self) -> list[dict[str, Any]]:
        """Each launcher's ``info()``."""
        refs = [launcher.info.remote() for launcher in self.launchers.values()]
        return list(await asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in refs)))

    async def _stop(self) -> None:
        refs = [launcher.stop.remote() for launcher in self.launchers.values()]
        if refs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(
                        *(asyncio.wrap_future(ref.future()) for ref in refs), return_exceptions=True
                    ),
                    STOP_TIMEOUT_S,
                )
        for launcher in self.launchers.values():
            with contextlib.suppress(Exception):
                self._ray.kill(launcher, no_restart=True)
        self.launchers = {}
