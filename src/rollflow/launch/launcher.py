"""The launch layer's one seam: a ``Launcher`` starts "trainer workers" and "servers", wherever they run.

``open_launcher(config)`` picks the backend from ``cluster.backend``:

- ``LocalLauncher`` (``local``): the trainer in a thread of this process, in a child process
  (``trainer.placement = "process"``) or as ``trainer.num_workers`` local worker processes; engine servers as
  subprocesses (``ServerGroup``).
- ``RayLauncher`` (``ray``, ``rollflow.launch.ray_launcher``): connects to the cluster, makes the placement
  plan, reserves its placement groups, and runs trainer workers and engine servers as actors there.

The orchestrator and ``rollflow.inference.setup`` only call ``start_trainer``, ``servers`` and read
``rank0_address``; the router and the client stay in this process and reach the servers by URL.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from rollflow.train.handle import TrainerHandle


class Launcher(Protocol):
    rank0_address: str
    """Address of trainer rank 0's host, where the weight sender listens (``weight_sync.master_address =
    "auto"``)."""

    def start_trainer(self, spec: Any) -> TrainerHandle:
        """Blocking: start the trainer a ``rollflow.train.process.TrainerSpec`` describes, return its handle."""
        ...

    def servers(self, model: str, num_servers: int, log_dir: Path, **options: Any) -> Any:
        """An async context manager yielding the started servers' base URLs (``ServerGroup``'s arguments)."""
        ...


class LocalLauncher:
    """Every process on this machine, as children of this one."""

    rank0_address = "127.0.0.1"

    def start_trainer(self, spec: Any) -> TrainerHandle:
        from rollflow.models.loading import load_causal_lm
        from rollflow.train.process import TrainerProcess
        from rollflow.train.trainer import Trainer

        config = spec.config
        if config.num_workers > 1:
            from rollflow.train.workers import TrainerWorkers

            return TrainerWorkers(spec)
        if config.placement == "process":
            return TrainerProcess(spec)
        return Trainer(load_causal_lm(spec.model_dir), **spec.trainer_kwargs())

    @contextlib.asynccontextmanager
    async def servers(
        self, model: str, num_servers: int, log_dir: Path, **options: Any
    ) -> AsyncIterator[list[str]]:
        from rollflow.launch.server_group import ServerGroup

        async with ServerGroup(model, num_servers, log_dir, **options) as group:
            yield group.urls


@contextlib.asynccontextmanager
async def open_launcher(
    config: Any, run_dir: Path | None = None, trainer: bool = True
) -> AsyncIterator[Launcher]:
    """The launcher ``config.cluster`` asks for; on exit (error and cancellation included) whatever the Ray
    backend reserved (actors, placement groups, its connection) is released. ``trainer = False``: servers only
    (``rollflow generate``, ``eval``): no trainer bundles are reserved.

    Raises:
        MissingExtraError: ``cluster.backend = "ray"`` without Ray installed.
        PlacementError: the plan does not fit the cluster, the cluster is unreachable, or Ray did not grant the
            placement groups within ``cluster.placement_timeout_s``.
    """
    if config.cluster.backend == "local":
        yield LocalLauncher()
        return
    from rollflow.launch.ray_launcher import RayLauncher

    async with RayLauncher.open(config, run_dir, trainer=trainer) as launcher:
        yield launcher
