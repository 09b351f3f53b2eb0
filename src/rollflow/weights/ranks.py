"""Rank offsets of a weight-transfer process group: the one place they are computed.

The trainer is rank 0; inference workers follow it. A deployment's workers take ``rank_offset + worker_rank``,
where ``rank_offset`` starts after the workers of the deployments before it. The orchestrator assigns one
offset per server (``per_server_init_infos``); the router, fanning one payload out to its workers, assigns one
per worker (``offsets_after``); a server reads its own (``global_rank``, ``update_list_index``).

Torch-free.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from rollflow.errors import InvalidTransferInfoError

if TYPE_CHECKING:
    from rollflow.inference.control import WorldSize

#: The trainer's rank; the first inference worker's ``rank_offset``.
TRAINER_RANK = 0
FIRST_WORKER_RANK = 1


def offsets_after(first: int, sizes: Iterable[int]) -> list[int]:
    """The ``rank_offset`` of each group of ``sizes`` workers placed one after another from ``first``."""
    offsets, offset = [], first
    for size in sizes:
        offsets.append(offset)
        offset += size
    return offsets


def global_rank(rank_offset: int, worker_rank: int) -> int:
    """The group rank of worker ``worker_rank`` of a server whose ``init_info.rank_offset`` is ``rank_offset``."""
    return rank_offset + worker_rank


def update_list_index(rank_offset: int) -> int:
    """Where a single-worker server finds its entry in vLLM's per-rank ``update_info`` list (ranks count the
    trainer, the list does not)."""
    return rank_offset - FIRST_WORKER_RANK


def uses_process_group(init_info: Mapping[str, object]) -> bool:
    """Whether ``init_info`` sets up a process group (ranks, ``rank_offset``): a gloo/nccl ``backend``, or
    vLLM's NCCL shape, which names no backend but a rendezvous (``master_address``)."""
    backend = init_info.get("backend")
    return backend in ("gloo", "nccl") or (backend is None and "master_address" in init_info)


def init_info_for_servers(
    init_info: Mapping[str, object], *, num_servers: int, workers_per_server: int, data_parallel_size: int = 1
) -> list[dict[str, object]]:
    """One ``init_info`` per server, for process-group backends: each deployment's ``rank_offset`` starts
    after the workers of the deployments before it (its workers then take ``rank_offset + worker_rank``).
    A vLLM data-parallel deployment runs one server per DP rank, each reporting the whole deployment's
    ``workers_per_server`` and placing itself by its DP index, so the offset advances every
    ``data_parallel_size`` servers. Other backends get the same payload for every server.

    Raises:
        InvalidTransferInfoError: the workers do not add up to ``init_info["world_size"] - 1``.
    """
    if not uses_process_group(init_info):
        return [copy.deepcopy(dict(init_info)) for _ in range(num_servers)]
    deployments = num_servers // data_parallel_size
    if deployments * workers_per_server + 1 != init_info["world_size"]:
        raise InvalidTransferInfoError(
            f"{num_servers} servers in {deployments} deployment(s) of {workers_per_server} workers do not match "
            f"init_info world_size {init_info['world_size']} (trainer + workers); rebuild it from get_world_size()"
        )
    first = int(init_info.get("rank_offset", FIRST_WORKER_RANK))  # type: ignore[call-overload]
    deployment_offsets = offsets_after(first, [workers_per_server] * deployments)
    payloads = []
    for server in range(num_servers):
        payload = copy.deepcopy(dict(init_info))
        payload["rank_offset"] = deployment_offsets[server // data_parallel_size]
        payloads.append(payload)
    return payloads


def per_server_init_infos(init_info: Mapping[str, object], world: WorldSize) -> list[dict[str, object]]:
    """What ``ControlPlane.init_weight_transfer`` gets: one payload for a single server (or the router, which
    assigns its workers' offsets itself), else one per server of ``world``."""
    if world.num_servers <= 1:
        return [dict(init_info)]
    return init_info_for_servers(
        init_info,
        num_servers=world.num_servers,
        workers_per_server=world.workers_per_server,
        data_parallel_size=world.data_parallel_size,
    )
