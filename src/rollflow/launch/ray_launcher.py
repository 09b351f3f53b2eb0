"""``RayLauncher``: the Ray backend of the launch layer (``cluster.backend = "ray"``).

Opening it connects to the cluster (``cluster.address``), makes the placement plan from the cluster's nodes
(logged), and reserves the plan's placement groups, waiting from the event loop within
``cluster.placement_timeout_s``. With ``address = "local"`` the plan is first checked against this machine,
so an infeasible one fails before Ray starts. It then starts trainer workers (``ray_trainer``) and servers
(``ray_servers``) in those groups when asked. Closing it ends every actor it started, removes the placement
groups and, when it connected, disconnects (a private instance stops with it). Actors and placement groups
belong to this driver's Ray job, so a driver killed with SIGKILL takes them along: Ray ends a job's
non-detached actors and removes its placement groups when its driver dies, and each server dies with its
launcher's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import structlog

from rollflow.launch.plan import Demand, PlacementPlan, make_plan
from rollflow.launch.ray_cluster import (
    PlacementGroups,
    actor_env,
    cluster_nodes,
    connect_ray,
    import_ray,
    local_machine_nodes,
)
from rollflow.train.handle import TrainerHandle

log = structlog.get_logger(__name__)


class RayLauncher:
    """Trainer workers and engine servers as Ray actors, where the placement plan puts them."""

    def __init__(self, ray: Any, config: Any, plan: PlacementPlan, groups: PlacementGroups):
        self.ray = ray
        self.config = config
        self.plan = plan
        self.groups = groups
        self.env = actor_env(config.cluster)
        self.trainer: Any = None
        self.servers_started: Any = None
        self.rank0_address = plan.rank0_node.address if plan.workers else "127.0.0.1"

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, config: Any, run_dir: Path | None = None, trainer: bool = True
    ) -> AsyncIterator[RayLauncher]:
        """Connect, plan and reserve (``trainer = False``: the servers only); on exit release everything (see
        the module docstring).

        Raises:
            MissingExtraError: Ray is not installed.
            PlacementError: the plan does not fit, the cluster is unreachable, or the placement groups were not
                granted within ``cluster.placement_timeout_s``.
        """
        cluster = config.cluster
        import_ray()
        if cluster.address == "local":  # an infeasible plan fails before Ray starts
            nodes = local_machine_nodes(cluster)
            make_plan(_demand(config, nodes, trainer), nodes)
        connection = await anyio.to_thread.run_sync(connect_ray, cluster, cluster.placement_timeout_s)
        ray = connection.ray
        try:
            nodes = cluster_nodes(ray)
            plan = make_plan(_demand(config, nodes, trainer), nodes)
            log.info("placement plan", plan="\n" + plan.describe())
            name = f"rollflow-{config.name}-{secrets.token_hex(3)}"
            groups = await PlacementGroups.reserve(ray, plan, cluster.placement_timeout_s, name=name)
            launcher = cls(ray, config, plan, groups)
            try:
                yield launcher
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(launcher._release)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(connection.close)

    def start_trainer(self, spec: Any) -> TrainerHandle:
        """Blocking: one actor per trainer rank, in the plan's trainer bundles."""
        from rollflow.launch.ray_trainer import RayTrainerWorkers

        self.trainer = RayTrainerWorkers(self.ray, spec, self.plan, self.groups.trainer, self.env)
        self.rank0_address = self.trainer.master_address
        return self.trainer

    @contextlib.asynccontextmanager
    async def servers(
        self, model: str, num_servers: int, log_dir: Path, **options: Any
    ) -> AsyncIterator[list[str]]:
        """The plan's servers, one launcher actor per node; yields their URLs in index order."""
        from rollflow.launch.ray_servers import RayServers

        if self.plan.demand.colocate and self.plan.demand.worker_gpus and self.trainer is None:
            raise RuntimeError("colocated servers share the trainer ranks' GPUs: start the trainer first")
        if num_servers != len(self.plan.servers):
            raise ValueError(f"the placement plan has {len(self.plan.servers)} servers, not {num_servers}")
        startup_timeout_s = options.pop("startup_timeout_s", 300.0)
        async with RayServers.run(
            self.ray,
            model,
            self.plan.servers_by_node(),
            self.groups.servers,
            Path(log_dir),
            self.env,
            startup_timeout_s,
            options,
            rank_gpus=[info["gpu_ids"] for info in self.trainer.ranks] if self.trainer is not None else None,
        ) as servers:
            self.servers_started = servers
            try:
                yield servers.urls
            finally:
                self.servers_started = None

    def _release(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.groups.remove(self.ray)


def _demand(config: Any, nodes: list[Any], trainer: bool) -> Demand:
    demand = Demand.from_config(config, nodes)
    return demand if trainer else dataclasses.replace(demand, num_workers=0, colocate=False)
