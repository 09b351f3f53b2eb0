"""The weight-transfer strategy interface, its errors, and the strategy registry.

A strategy moves the trainer's weights into inference engines. It has two halves:
- the sender (trainer side, this package): ``create_init_info`` once, ``setup(client)`` once, then one
  ``push`` per policy version, each doing ``start_weight_update`` → ``update_named_weights(update_info)`` →
  ``finish_weight_update`` over the client. The caller (the weight barrier) pauses and resumes the engines
  around ``push``; a strategy never pauses or resumes.
- the receiver (engine-server side, ``rollflow.weights.receiver``): built from ``init_info`` by the server's
  ``/init_weight_transfer_engine``; each ``/update_weights`` turns one ``update_info`` into named tensors.

``init_info`` and ``update_info`` are plain JSON dicts using vLLM's field names where vLLM has them
(``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``names``, ``dtype_names``, ``shapes``),
plus ``backend`` (which receiver to build) and ``policy_version`` (stamped on later tokens). For vLLM servers
(``engine="vllm"``) they carry vLLM 0.33's keys only, since vLLM rejects unknown ones; the policy version then
travels only as ``/finish_weight_update``'s ``weight_version``. rollflow's own receivers accept both shapes.

This module stays free of torch so configuration and the orchestrator can import it cheaply.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

from rollflow.errors import RollflowError

#: Strategy names accepted by ``create_strategy`` (and proposed for ``weight_sync.strategy``).
STRATEGIES: tuple[str, ...] = ("local", "broadcast", "checkpoint", "cuda_ipc")

#: The receiver backends an ``init_info["backend"]`` may name.
RECEIVER_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "checkpoint", "ipc")


class WeightTransferError(RollflowError):
    """A weight transfer failed; the message says which side and why."""


class InvalidTransferInfoError(WeightTransferError, ValueError):
    """An ``init_info`` or ``update_info`` is malformed (a server answers it with a 400)."""


class WeightTransferTimeoutError(WeightTransferError, TimeoutError):
    """A weight transfer (or forming its process group) did not finish within its timeout."""


class WeightUpdateClient(Protocol):
    """What a remote sender needs from an inference client (``RemoteInferenceClient`` fans each call out)."""

    async def get_world_size(self) -> int: ...

    async def init_weight_update_communicator(self, init_info: dict[str, Any]) -> Any: ...

    async def start_weight_update(self) -> Any: ...

    async def update_named_weights(self, update_info: dict[str, Any]) -> Any: ...

    async def finish_weight_update(self, weight_version: int | None = None) -> Any: ...


class WeightSender(abc.ABC):
    """Trainer side of one strategy, bound to one ``init_info``.

    Lifecycle: ``await setup(client)`` once, ``await push(...)`` per policy version, ``close()`` at the end.
    After a failed or cancelled push the transfer state is unknown (a half-done broadcast), so the sender
    refuses further pushes; close it and build a new one (``connect_sender``).
    """

    def __init__(self, init_info: dict[str, Any]):
        self.init_info = init_info
        #: Why this sender can no longer push (None while it can); ``WeightTransfer`` then reconnects.
        self.broken: str | None = None

    @abc.abstractmethod
    async def setup(self, client: Any) -> None:
        """Connect the receivers: check the inference world size and send ``init_info`` to every server.

        Raises:
            WeightTransferError: the servers report another world size than ``init_info`` was made for.
            WeightTransferTimeoutError: the receivers did not join within the strategy's timeout.
        """

    @abc.abstractmethod
    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        """Send ``named_weights`` (Hugging Face state-dict names) to every engine as ``policy_version``:
        start → update → finish over ``client``. The caller pauses the engines before and resumes after.

        Raises:
            WeightTransferError: the transfer failed, or the sender is broken by an earlier failure.
            WeightTransferTimeoutError: the transfer took longer than the strategy's timeout.
        """

    def close(self) -> None:  # noqa: B027 - a no-op default is the right behaviour for stateless senders
        """Release sockets, process groups and files. Idempotent."""


class WeightTransferStrategy(abc.ABC):
    """How weights travel from trainer to engines; see the module docstring."""

    name: ClassVar[str]

    @abc.abstractmethod
    def create_init_info(self, inference_world_size: int) -> dict[str, Any]:
        """The ``init_info`` every server receives, for ``inference_world_size`` workers in all (ask the
        servers with ``client.get_world_size()``; never take it from config)."""

    @abc.abstractmethod
    def create_sender(self, init_info: dict[str, Any]) -> WeightSender:
        """A sender for ``init_info`` (from ``create_init_info`` of this strategy)."""


def create_strategy(name: str, **options: Any) -> WeightTransferStrategy:
    """Build the strategy called ``name`` (one of ``STRATEGIES``) with its keyword options.

    Raises:
        ValueError: an unknown strategy name.
        TypeError: an option the strategy does not take.
    """
    if name == "local":
        from rollflow.weights.local import LocalStrategy

        return LocalStrategy(**options)
    if name == "broadcast":
        from rollflow.weights.broadcast import BroadcastStrategy

        return BroadcastStrategy(**options)
    if name == "checkpoint":
        from rollflow.weights.checkpoint import CheckpointStrategy

        return CheckpointStrategy(**options)
    if name == "cuda_ipc":
        from rollflow.weights.cuda_ipc import CudaIpcStrategy

        return CudaIpcStrategy(**options)
    raise ValueError(f"unknown weight transfer strategy {name!r}; choose one of {', '.join(STRATEGIES)}")


class WeightTransfer:
    """A strategy plus its current sender, for the weight barrier: ``push`` connects on first use, and again
    after any failed push (a timed-out broadcast, a server that died and was dropped, so the world size
    changed).

    Args:
        strategy: from ``create_strategy``.
    """

    def __init__(self, strategy: WeightTransferStrategy):
        self.strategy = strategy
        self.sender: WeightSender | None = None

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        """Send ``named_weights`` as ``policy_version`` (engines paused by the caller).

        Raises:
            WeightTransferError, WeightTransferTimeoutError: as ``WeightSender.setup`` and ``push``; the next
                call reconnects.
        """
        if self.sender is not None and self.sender.broken is not None:
            self.close()
        if self.sender is None:
            self.sender = await connect_sender(self.strategy, client)
        try:
            await self.sender.push(client, named_weights, policy_version)
        except BaseException:
            # Whatever failed (a timeout, a server error, cancellation), the servers may hold a half-done
            # update: the next push starts over from init_weight_transfer_engine.
            self.close()
            raise

    def close(self) -> None:
        """Close the current sender. Idempotent."""
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


async def connect_sender(strategy: WeightTransferStrategy, client: Any) -> WeightSender:
    """Ask the servers for their world size, build ``init_info`` and a sender, and set it up.

    Raises:
        WeightTransferError, WeightTransferTimeoutError: as ``WeightSender.setup``.
    """
    world_size = await client.get_world_size() if hasattr(client, "get_world_size") else 1
    sender = strategy.create_sender(strategy.create_init_info(world_size))
    try:
        await sender.setup(client)
    except BaseException:
        sender.close()
        raise
    return sender


def uses_process_group(init_info: dict[str, Any]) -> bool:
    """Whether ``init_info`` sets up a process group (ranks, ``rank_offset``): a gloo/nccl ``backend``, or
    vLLM's NCCL shape, which names no backend but a rendezvous (``master_address``)."""
    backend = init_info.get("backend")
    return backend in ("gloo", "nccl") or (backend is None and "master_address" in init_info)


def init_info_for_servers(
    init_info: dict[str, Any], *, num_servers: int, workers_per_server: int, data_parallel_size: int = 1
) -> list[dict[str, Any]]:
    """One ``init_info`` per server, for process-group backends: each deployment's ``rank_offset`` starts
    after the workers of the deployments before it (its workers then take ``rank_offset + worker_rank``).
    A vLLM data-parallel deployment runs one server per DP rank, each reporting the whole deployment's
    ``workers_per_server`` and placing itself by its DP index, so the offset advances every
    ``data_parallel_size`` servers. Other backends get the same payload for every server.

    Raises:
        InvalidTransferInfoError: the workers do not add up to ``init_info["world_size"] - 1``.
    """
    if not uses_process_group(init_info):
        return [copy.deepcopy(init_info) for _ in range(num_servers)]
    deployments = num_servers // data_parallel_size
    if deployments * workers_per_server + 1 != init_info["world_size"]:
        raise InvalidTransferInfoError(
            f"{num_servers} servers in {deployments} deployment(s) of {workers_per_server} workers do not match "
            f"init_info world_size {init_info['world_size']} (trainer + workers); rebuild it from get_world_size()"
        )
    payloads = []
    for server in range(num_servers):
        payload = copy.deepcopy(init_info)
        payload["rank_offset"] = (
            int(init_info.get("rank_offset", 1)) + (server // data_parallel_size) * workers_per_server
        )
        payloads.append(payload)
    return payloads


async def server_init_infos(init_info: dict[str, Any], client: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """What to pass to ``client.init_weight_update_communicator``: per-server payloads when the client fans out
    to several servers (``server_urls``, ``get_world_size_per_server``), else ``init_info`` itself."""
    urls = getattr(client, "server_urls", None)
    per_server = getattr(client, "get_world_size_per_server", None)
    if not urls or per_server is None or len(urls) == 1:
        return init_info
    return init_info_for_servers(
        init_info,
        num_servers=len(urls),
        workers_per_server=await per_server(),
        data_parallel_size=getattr(client, "data_parallel_size", 1),
    )
