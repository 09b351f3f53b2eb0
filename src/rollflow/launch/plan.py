"""The placement plan: which node runs each trainer worker and each engine server (pure: no Ray, no torch).

From what a run asks for (``Demand``, read from the config) and what the cluster has (``Node``s), the plan
names one bundle per trainer worker and one per engine server, each pinned to a node:

- Trainer workers fill nodes in order, as few nodes as they fit on; rank ``r`` is the ``r``-th worker, so rank 0
  sits on the first node holding workers, which hosts the torch.distributed rendezvous and the weight sender.
  Nodes with more GPUs come first and, among equals, the head node (where the driver runs): a head node
  without GPUs never gets rank 0 of a GPU trainer.
- Each engine server is one bundle on one node holding its whole tensor-parallel group; servers go first-fit
  over the nodes, most free GPUs first, after the workers took theirs.
- Colocated (``inference.colocate``): a server takes no GPUs of its own but shares those of trainer workers
  on one node (``ServerSlot.worker_ranks``); its bundle holds only its CPUs.

An infeasible plan raises ``PlacementError`` naming the demand, each node's resources and the keys to change,
before any process starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.errors import PlacementError


@dataclass(frozen=True)
class Node:
    """One node of the cluster and its resources (totals, as Ray reports them)."""

    node_id: str
    address: str
    cpus: float
    gpus: float = 0.0
    head: bool = False

    def describe(self) -> str:
        role = ", head" if self.head else ""
        return f"{self.address} [{self.node_id[:8]}{role}]: {self.cpus:g} CPU, {self.gpus:g} GPU"


@dataclass(frozen=True)
class Demand:
    """What a run asks of the cluster."""

    num_workers: int
    worker_gpus: int
    """GPUs per trainer worker: 1 on GPUs, 0 on CPUs."""
    worker_cpus: float
    num_servers: int
    """Engine servers to place (0: in-process engines, or servers rollflow does not start)."""
    server_gpus: int
    """GPUs per server: its tensor-parallel size on GPUs, 0 on CPUs."""
    server_cpus: float
    colocate: bool = False

    @classmethod
    def from_config(cls, config: Any, nodes: Sequence[Node]) -> Demand:
        """The demand of a ``RunConfig``. ``device = "auto"`` (trainer, torch engine) means GPUs when the
        cluster has any; vLLM servers always take GPUs."""
        has_gpus = any(node.gpus >= 1 for node in nodes)
        trainer_device = config.trainer.device
        worker_gpus = 1 if trainer_device == "cuda" or (trainer_device == "auto" and has_gpus) else 0
        inference = config.inference
        starts_servers = inference.mode == "http" and not (
            inference.external_proxy_url or inference.external_server_urls
        )
        # Declared with the other vLLM options in [inference]; 1 until then.
        tensor_parallel = int(getattr(inference, "tensor_parallel_size", 1))
        if inference.engine == "vllm":
            server_gpus = tensor_parallel
        else:  # rollflow's torch engine: one device, no tensor parallelism
            device = inference.device
            server_gpus = 1 if device == "cuda" or (device == "auto" and has_gpus) else 0
        return cls(
            num_workers=config.trainer.num_workers,
            worker_gpus=worker_gpus,
            worker_cpus=config.cluster.cpus_per_worker,
            num_servers=inference.num_servers if starts_servers else 0,
            server_gpus=server_gpus,
            server_cpus=config.cluster.cpus_per_server,
            colocate=inference.colocate,
        )

    def describe(self) -> str:
        parts = [f"{self.num_workers} trainer worker(s) x {_resources(self.worker_cpus, self.worker_gpus)}"]
        if self.num_servers:
            gpus = 0 if self.colocate else self.server_gpus
            shared = (
                f", sharing {self.server_gpus} trainer GPU(s)" if self.colocate and self.server_gpus else ""
            )
            parts.append(f"{self.num_servers} server(s) x {_resources(self.server_cpus, gpus)}{shared}")
        total_cpus = self.num_workers * self.worker_cpus + self.num_servers * self.server_cpus
        total_gpus = self.num_workers * self.worker_gpus + (
            0 if self.colocate else self.num_servers * self.server_gpus
        )
        return f"{' + '.join(parts)} = {_resources(total_cpus, total_gpus)}"


@dataclass(frozen=True)
class Bundle:
    """Resources reserved on one node (one Ray placement-group bundle)."""

    node_id: str
    cpus: float
    gpus: float = 0.0

    def resources(self) -> dict[str, float]:
        """Ray's form: ``{"CPU": …, "GPU": …}`` without zero entries."""
        resources = {"CPU": self.cpus, "GPU": self.gpus}
        return {name: amount for name, amount in resources.items() if amount > 0}


@dataclass(frozen=True)
class WorkerSlot:
    rank: int
    node: Node
    bundle: Bundle


@dataclass(frozen=True)
class ServerSlot:
    index: int
    node: Node
    bundle: Bundle
    gpus: int
    """GPUs the server uses (its tensor-parallel group); with colocation, those of ``worker_ranks``."""
    worker_ranks: tuple[int, ...] = ()
    """Colocated: the trainer ranks whose GPUs the server shares."""


@dataclass(frozen=True)
class PlacementPlan:
    demand: Demand
    nodes: tuple[Node, ...]
    workers: tuple[WorkerSlot, ...]
    servers: tuple[ServerSlot, ...] = field(default=())

    @property
    def rank0_node(self) -> Node:
        """The node of trainer rank 0 (rendezvous, weight sender); a plan without workers has none."""
        return self.workers[0].node

    def servers_by_node(self) -> dict[str, list[ServerSlot]]:
        """Servers grouped by node id, in index order (one launcher per node runs them)."""
        grouped: dict[str, list[ServerSlot]] = {}
        for server in self.servers:
            grouped.setdefault(server.node.node_id, []).append(server)
        return grouped

    def describe(self) -> str:
        """The plan as text, a line per node (``rollflow run --dry-run``)."""
        lines = [f"placement plan: {self.demand.describe()}"]
        for node in self.nodes:
            ranks = [slot.rank for slot in self.workers if slot.node.node_id == node.node_id]
            servers = [slot for slot in self.servers if slot.node.node_id == node.node_id]
            if not ranks and not servers:
                lines.append(f"  {node.describe()}: unused")
                continue
            held = []
            if ranks:
                zero = " (rank 0: rendezvous, weight sender)" if 0 in ranks else ""
                held.append(f"trainer ranks {_ranges(ranks)}{zero}")
            if servers:
                held.append(f"servers {_ranges([slot.index for slot in servers])}")
            lines.append(f"  {node.describe()}: {'; '.join(held)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (node ids, ranks, servers, bundles)."""
        return {
            "rank0_node": self.rank0_node.node_id if self.workers else None,
            "workers": [
                {"rank": s.rank, "node": s.node.node_id, "address": s.node.address, **s.bundle.resources()}
                for s in self.workers
            ],
            "servers": [
                {
                    "index": s.index,
                    "node": s.node.node_id,
                    "address": s.node.address,
                    "gpus": s.gpus,
                    "worker_ranks": list(s.worker_ranks),
                    **s.bundle.resources(),
                }
                for s in self.servers
            ],
        }


def make_plan(demand: Demand, nodes: Iterable[Node]) -> PlacementPlan:
    """Place ``demand`` on ``nodes`` (see the module docstring).

    Raises:
        PlacementError: the demand does not fit; the message names the demand, every node and the keys.
    """
    nodes = tuple(nodes)
    if not nodes:
        raise PlacementError(
            "placement: the Ray cluster reports no alive nodes; start one with `ray start --head`"
        )
    if demand.colocate and demand.num_servers and demand.worker_gpus == 0 and demand.server_gpus:
        _fail(
            demand,
            nodes,
            "inference.colocate = true shares the trainer workers' GPUs with the servers, but the trainer runs "
            "on CPUs (trainer.device)",
            "set trainer.device = 'cuda' (or 'auto' on a cluster with GPUs), or inference.colocate = false",
        )
    free = {node.node_id: [node.cpus, node.gpus] for node in nodes}
    order = sorted(nodes, key=lambda node: (-node.gpus, not node.head, node.address, node.node_id))
    workers = _place_workers(demand, nodes, order, free)
    servers = (
        _place_colocated(demand, nodes, workers, free)
        if demand.colocate
        else _place_servers(demand, nodes, order, free)
    )
    return PlacementPlan(demand=demand, nodes=tuple(order), workers=tuple(workers), servers=tuple(servers))


def _place_workers(
    demand: Demand, nodes: tuple[Node, ...], order: list[Node], free: dict[str, list[float]]
) -> list[WorkerSlot]:
    if demand.worker_gpus:
        total = sum(int(node.gpus) for node in nodes)
        if demand.num_workers * demand.worker_gpus > total:
            _fail(
                demand,
                nodes,
                f"trainer.num_workers = {demand.num_workers} needs one GPU per worker, and the cluster has "
                f"{total} GPU(s)",
                f"set trainer.num_workers <= {total}, or add GPU nodes",
            )
    workers: list[WorkerSlot] = []
    for node in order:
        while len(workers) < demand.num_workers and _fits(
            free[node.node_id], demand.worker_cpus, demand.worker_gpus
        ):
            _take(free[node.node_id], demand.worker_cpus, demand.worker_gpus)
            bundle = Bundle(node.node_id, demand.worker_cpus, demand.worker_gpus)
            workers.append(WorkerSlot(len(workers), node, bundle))
    if len(workers) < demand.num_workers:
        _fail(
            demand,
            nodes,
            f"only {len(workers)} of trainer.num_workers = {demand.num_workers} worker bundles "
            f"({_resources(demand.worker_cpus, demand.worker_gpus)} each) fit",
            "lower trainer.num_workers or cluster.cpus_per_worker, or add nodes",
        )
    return workers


def _place_servers(
    demand: Demand, nodes: tuple[Node, ...], order: list[Node], free: dict[str, list[float]]
) -> list[ServerSlot]:
    if not demand.num_servers:
        return []
    largest = max(int(node.gpus) for node in nodes)
    if demand.server_gpus > largest:
        _fail(
            demand,
            nodes,
            f"inference.tensor_parallel_size = {demand.server_gpus}: a server's tensor-parallel group must sit "
            f"on one node, and the largest node has {largest} GPU(s)",
            f"set inference.tensor_parallel_size <= {largest} (and raise inference.num_servers), or use "
            "larger nodes",
        )
    servers: list[ServerSlot] = []
    for index in range(demand.num_servers):
        # First fit over the nodes with the most free GPUs (then CPUs): servers spread over the free nodes.
        candidates = sorted(order, key=lambda node: (-free[node.node_id][1], -free[node.node_id][0]))
        for node in candidates:
            if _fits(free[node.node_id], demand.server_cpus, demand.server_gpus):
                _take(free[node.node_id], demand.server_cpus, demand.server_gpus)
                bundle = Bundle(node.node_id, demand.server_cpus, demand.server_gpus)
                servers.append(ServerSlot(index, node, bundle, demand.server_gpus))
                break
        else:
            _fail(
                demand,
                nodes,
                f"after the trainer workers, only {len(servers)} of inference.num_servers = {demand.num_servers} "
                f"server bundles ({_resources(demand.server_cpus, demand.server_gpus)} each) fit",
                "lower inference.num_servers, trainer.num_workers, inference.tensor_parallel_size or "
                "cluster.cpus_per_server, or add nodes",
            )
    return servers


def _place_colocated(
    demand: Demand, nodes: tuple[Node, ...], workers: list[WorkerSlot], free: dict[str, list[float]]
) -> list[ServerSlot]:
    """Each server on the GPUs of ``server_gpus`` trainer workers of one node (CPU-only: beside one worker)."""
    share = max(demand.server_gpus, 1)
    by_node: dict[str, list[int]] = {}
    for slot in workers:
        by_node.setdefault(slot.node.node_id, []).append(slot.rank)
    node_of = {slot.node.node_id: slot.node for slot in workers}
    servers: list[ServerSlot] = []
    groups = [
        ranks[i : i + share] for ranks in by_node.values() for i in range(0, len(ranks) - share + 1, share)
    ]
    if demand.worker_gpus == 0:  # CPU: nothing to share, a server beside each worker in turn
        groups = [[slot.rank] for slot in workers]
    for index in range(demand.num_servers):
        if not groups:
            _fail(
                demand,
                nodes,
                f"inference.colocate = true: each server shares the GPUs of {share} trainer worker(s) on one node, "
                f"and the trainer's {demand.num_workers} worker(s) make room for {len(servers)} server(s), not "
                f"inference.num_servers = {demand.num_servers}",
                "lower inference.num_servers or inference.tensor_parallel_size, or raise trainer.num_workers",
            )
        ranks = groups.pop(0) if demand.worker_gpus else groups[index % len(groups)]
        node = node_of[workers[ranks[0]].node.node_id]
        if not _fits(free[node.node_id], demand.server_cpus, 0):
            _fail(
                demand,
                nodes,
                f"server {index} shares GPUs on {node.address} but its {demand.server_cpus:g} CPU(s) do not fit there",
                "lower cluster.cpus_per_server or cluster.cpus_per_worker",
            )
        _take(free[node.node_id], demand.server_cpus, 0)
        gpus = demand.server_gpus if demand.worker_gpus else 0
        servers.append(ServerSlot(index, node, Bundle(node.node_id, demand.server_cpus), gpus, tuple(ranks)))
    return servers


def _fits(free: list[float], cpus: float, gpus: float) -> bool:
    return free[0] + 1e-9 >= cpus and free[1] + 1e-9 >= gpus


def _take(free: list[float], cpus: float, gpus: float) -> None:
    free[0] -= cpus
    free[1] -= gpus


def _fail(demand: Demand, nodes: Sequence[Node], reason: str, fix: str) -> None:
    raise PlacementError(
        f"placement: {reason}. The run asks for {demand.describe()}; the cluster has "
        + "; ".join(node.describe() for node in nodes)
        + f". Fix: {fix}"
    )


def _resources(cpus: float, gpus: float) -> str:
    return f"{{{cpus:g} CPU, {gpus:g} GPU}}"


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2, 5``."""
    spans: list[str] = []
    start = previous = values[0]
    for value in [*values[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ", ".join(spans)
