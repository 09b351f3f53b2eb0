"""The Ray side of the launch layer: connect to a cluster, read its nodes, reserve the plan's placement groups.

``connect_ray`` joins the cluster ``cluster.address`` names (or starts a private instance for ``local``), with
a reachability probe first so that a wrong address fails in seconds, not after Ray's own minutes of retries.
``PlacementGroups.reserve`` creates one placement group for the trainer workers (a bundle per rank) and one
per node that runs servers (a bundle holding that node's servers), each bundle pinned to the node the plan
chose (Ray's ``ray.io/node-id`` label), and waits for them from the event loop: progress is logged every
``PROGRESS_INTERVAL_S``, and past ``cluster.placement_timeout_s`` the groups are removed and a
``PlacementError`` says what was asked, what the cluster has free and which keys to change (Ray itself only
times out, or waits forever on a group it cannot place).

Ray is imported inside the functions, never at module scope.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from rollflow.errors import MissingExtraError, PlacementError
from rollflow.launch.plan import Node, PlacementPlan

log = structlog.get_logger(__name__)

NODE_LABEL = "ray.io/node-id"
PROGRESS_INTERVAL_S = 30.0
"""Longest time between two progress lines while the placement groups are pending."""
PROBE_TIMEOUT_S = 5.0


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        MissingExtraError: Ray is not installed (naming ``cluster.backend`` and the install command).
    """
    try:
        import ray
    except ImportError:
        raise MissingExtraError(
            "cluster.backend = 'ray' needs Ray: pip install 'rollflow[ray]' (or set cluster.backend = 'local')"
        ) from None
    return ray


def actor_env(cluster: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables every actor gets: this process's variables matching ``cluster.forward_env``, then
    ``cluster.env``."""
    environ = os.environ if environ is None else environ
    forwarded = {
        name: value
        for name, value in environ.items()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in cluster.forward_env)
    }
    return {**forwarded, **cluster.env}


def local_machine_nodes(cluster: Any) -> list[Node]:
    """This machine as the one node a private Ray instance (``address = "local"``) would have, read without
    starting Ray: ``cluster.num_cpus`` or the CPU count, and the GPUs ``CUDA_VISIBLE_DEVICES`` or
    ``/dev/nvidia*`` show."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = len([device for device in visible.split(",") if device.strip() and device.strip() != "-1"])
    else:
        gpus = len([path for path in Path("/dev").glob("nvidia[0-9]*")])
    cpus = cluster.num_cpus or os.cpu_count() or 1
    return [Node("local", "127.0.0.1", float(cpus), float(gpus), head=True)]


def cluster_nodes(ray: Any) -> list[Node]:
    """The alive nodes of the connected cluster, with their total CPUs and GPUs."""
    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = info.get("Resources", {})
        nodes.append(
            Node(
                node_id=info["NodeID"],
                address=info["NodeManagerAddress"],
                cpus=float(resources.get("CPU", 0)),
                gpus=float(resources.get("GPU", 0)),
                head="node:__internal_head__" in resources,
            )
        )
    return nodes


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail fast when a ``HOST:PORT`` or ``ray://HOST:PORT`` address does not accept connections.

    Raises:
        PlacementError: naming ``cluster.address``, the error and how to start or join a cluster.
    """
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    host, port = parts.hostname, parts.port
    if host is None or port is None:
        return
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as error:
        raise PlacementError(
            f"cluster.address = {address!r}: cannot reach the Ray cluster there ({error}). Start its head with "
            "`ray start --head` and use the address it prints, set cluster.address = 'auto' on a machine that "
            "joined it with `ray start --address`, or 'local' for a private instance"
        ) from None


class RayConnection:
    """This process's connection to Ray, owned by a thread that lives until ``close``.

    A private instance (``address = "local"``) is made of child processes that Ray ties to the thread that
    started them (``PR_SET_PDEATHSIG`` fires when that *thread* ends): a short-lived worker thread would take
    them down with it. So one thread calls ``ray.init``, waits, and calls ``ray.shutdown`` when closed; if this
    process dies instead, the kernel ends the private instance with it.
    """

    def __init__(self, ray: Any, options: dict[str, Any] | None):
        self.ray = ray
        self.owned = options is not None
        self._options = options or {}
        self._started = threading.Event()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        if self.owned:
            self._thread = threading.Thread(target=self._own, name="rollflow-ray", daemon=True)
            self._thread.start()

    def _own(self) -> None:
        try:
            self.ray.init(**self._options)
        except BaseException as error:
            self.error = error
            self._started.set()
            return
        self._started.set()
        self._stop.wait()
        try:
            self.ray.shutdown()
        finally:
            self._stopped.set()

    def wait_started(self, timeout_s: float) -> bool:
        return not self.owned or self._started.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Disconnect (and stop a private instance) when this connection made it. Idempotent."""
        if self.owned and self._started.is_set() and self.error is None:
            self._stop.set()
            self._stopped.wait(timeout_s)


def connect_ray(cluster: Any, timeout_s: float) -> RayConnection:
    """Connect this process to the cluster ``cluster.address`` names (blocking; run it off the event loop).

    A process already connected (``ray.init`` called by the caller) keeps its connection, and ``close`` leaves it.

    Raises:
        MissingExtraError: Ray is not installed.
        PlacementError: the address is unreachable, or connecting took longer than ``timeout_s``.
    """
    ray = import_ray()
    if ray.is_initialized():
        return RayConnection(ray, None)
    address = cluster.address
    options: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
        "runtime_env": {"env_vars": actor_env(cluster)},
    }
    if address == "local":
        options["address"] = "local"
        if cluster.num_cpus is not None:
            options["num_cpus"] = cluster.num_cpus
    else:
        probe_address(address)
        options["address"] = address
    connection = RayConnection(ray, options)
    # ray.init retries an unresponsive head for minutes: wait for it at most timeout_s.
    if not connection.wait_started(timeout_s):
        raise PlacementError(
            f"cluster.address = {address!r}: Ray did not connect within cluster.placement_timeout_s = "
            f"{timeout_s:g} s; check that the head runs (`ray status`) and the address and port are right"
        )
    if connection.error is not None:
        error = connection.error
        raise PlacementError(
            f"cluster.address = {address!r}: cannot connect to Ray ({type(error).__name__}: {error}); start a "
            "cluster with `ray start --head`, or set cluster.address = 'local' for a private instance"
        ) from error
    log.info("connected to Ray", address=address, nodes=len(cluster_nodes(ray)))
    return connection


@dataclass
class PlacementGroups:
    """The plan's placement groups once granted: ``trainer`` (bundle ``r`` for rank ``r``) and, per node id
    that runs servers, one group of one bundle."""

    plan: PlacementPlan
    trainer: Any = None
    servers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def reserve(
        cls, ray: Any, plan: PlacementPlan, timeout_s: float, name: str = "rollflow"
    ) -> PlacementGroups:
        """Create the plan's placement groups and wait until Ray grants them all (from the event loop).

        Raises:
            PlacementError: not granted within ``timeout_s`` (the groups are removed first).
        """
        from ray.util.placement_group import placement_group

        groups = cls(plan)
        wanted: dict[str, Any] = {}
        if plan.workers:
            groups.trainer = placement_group(
                [slot.bundle.resources() for slot in plan.workers],
                strategy="PACK",
                name=f"{name}-trainer",
                bundle_label_selector=[{NODE_LABEL: slot.node.node_id} for slot in plan.workers],
            )
            wanted["trainer workers"] = groups.trainer
        for node_id, servers in plan.servers_by_node().items():
            cpus = sum(slot.bundle.cpus for slot in servers)
            gpus = sum(slot.bundle.gpus for slot in servers)
            resources = {k: v for k, v in {"CPU": cpus, "GPU": gpus}.items() if v > 0}
            groups.servers[node_id] = placement_group(
                [resources],
                strategy="STRICT_PACK",
                name=f"{name}-servers-{node_id[:8]}",
                bundle_label_selector=[{NODE_LABEL: node_id}],
            )
            wanted[f"servers {[slot.index for slot in servers]} on {servers[0].node.address}"] = (
                groups.servers[node_id]
            )
        try:
            await _wait_ready(ray, plan, wanted, timeout_s)
        except BaseException:
            groups.remove(ray)
            raise
        return groups

    def remove(self, ray: Any) -> None:
        """Remove every group (their actors die with them). Idempotent."""
        from ray.util.placement_group import remove_placement_group

        for group in [self.trainer, *self.servers.values()]:
            if group is not None:
                try:
                    remove_placement_group(group)
                except Exception as error:
                    log.warning("could not remove a placement group", error=str(error))
        self.trainer = None
        self.servers = {}


async def _wait_ready(ray: Any, plan: PlacementPlan, wanted: dict[str, Any], timeout_s: float) -> None:
    pending = {what: asyncio.wrap_future(group.ready().future()) for what, group in wanted.items()}
    started = time.monotonic()
    deadline = started + timeout_s
    interval = min(PROGRESS_INTERVAL_S, max(timeout_s / 4, 1.0))  # a few progress lines even for short waits
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PlacementError(_timeout_message(ray, plan, sorted(pending), timeout_s))
            done, _ = await asyncio.wait(
                pending.values(),
                timeout=min(interval, remaining),
                return_when=asyncio.ALL_COMPLETED,
            )
            for what, future in list(pending.items()):
                if future in done:
                    future.result()
                    del pending[what]
            if pending:
                log.info(
                    "waiting for Ray placement groups",
                    pending=sorted(pending),
                    waited_s=round(time.monotonic() - started),
                    timeout_s=timeout_s,
                    available=_available(ray),
                )
    finally:
        for future in pending.values():
            future.cancel()


def _available(ray: Any) -> str:
    try:
        free = ray.available_resources()
    except Exception:
        return "unknown"
    return f"{free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU"


def _timeout_message(ray: Any, plan: PlacementPlan, pending: list[str], timeout_s: float) -> str:
    try:
        nodes = "; ".join(node.describe() for node in cluster_nodes(ray))
    except Exception:
        nodes = "unknown"
    return (
        f"placement: Ray did not grant the placement groups of {', '.join(pending)} within "
        f"cluster.placement_timeout_s = {timeout_s:g} s. The run asks for {plan.demand.describe()}; the cluster "
        f"has {nodes}, of which {_available(ray)} free now (other jobs or actors hold the rest, or a node "
        "left). Fix: free the resources (`ray status`), raise cluster.placement_timeout_s while nodes join, "
        "or lower trainer.num_workers, inference.num_servers, cluster.cpus_per_worker or cluster.cpus_per_server"
    )


def dry_run_plan(config: Any) -> PlacementPlan:
    """The plan ``config`` would run with, without starting anything: for ``address = "local"`` this machine
    as Ray would see it; otherwise the cluster's nodes (this connects and disconnects, starting no actor).

    Raises:
        MissingExtraError, PlacementError: as ``connect_ray`` and ``make_plan``.
    """
    from rollflow.launch.plan import Demand, make_plan

    cluster = config.cluster
    if cluster.address == "local":
        import_ray()
        nodes = local_machine_nodes(cluster)
    else:
        connection = connect_ray(cluster, cluster.placement_timeout_s)
        try:
            nodes = cluster_nodes(connection.ray)
        finally:
            connection.close()
    return make_plan(Demand.from_config(config, nodes), nodes)
