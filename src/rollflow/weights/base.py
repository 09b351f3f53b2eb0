"""The weight-transfer interface, its errors, the strategy registry, and the helpers both halves share.

A strategy moves the trainer's weights into inference engines in three parts:
- the **control half** (``WeightSender``, in the orchestrator, async): asks the servers for their world size,
  sends ``init_info`` (``/init_weight_transfer_engine``), and per policy version ``/start_weight_update`` →
  ``/update_weights`` → ``/finish_weight_update``, each bounded by the strategy's timeout. It never touches a
  tensor: it drives the transport half through a ``WeightSource``.
- the **transport half** (a picklable spec, e.g. ``BroadcastTransport``): shipped by value to wherever the
  weights are (the trainer thread, the trainer process, each data-parallel rank) and run there as
  ``TransportCall(spec, op)(rank, named_weights)``. Every rank iterates its named weights (a DTensor joins its
  ``full_tensor()`` gather), casts them to the transfer dtype, and only rank 0 sends; rank 0 also picks the
  rendezvous (address, port) on its own host and reports it back as the call's result. State that must outlive
  one call (a process group, a TCP store, an HTTP server) lives in that process's session registry
  (``rollflow.weights.transport``), keyed by the spec's ``transfer_id``.
- the **receiver** (engine-server side, ``rollflow.weights.receiver``): built from ``init_info`` by
  ``/init_weight_transfer_engine``; each ``/update_weights`` turns one ``update_info`` into named tensors.

The caller (the weight barrier) pauses and resumes the engines around a push; a strategy never does.

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
import inspect
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import anyio
import structlog

from rollflow.errors import (
    InvalidTransferInfoError,
    RollflowError,
    WeightTransferError,
    WeightTransferTimeoutError,
)
from rollflow.weights.registry import strategy_names

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig

log = structlog.get_logger(__name__)

#: Strategy names accepted by ``create_strategy`` (those registered in ``rollflow.weights.registry``).
STRATEGIES: tuple[str, ...] = strategy_names()

#: The receiver backends an ``init_info["backend"]`` may name.
RECEIVER_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "checkpoint", "ipc")

#: Dtypes weights may be cast to on the trainer side before they travel (``weight_sync.dtype``).
TRANSFER_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")

#: How long the control half waits, after the trainer side failed, for the servers' side to report its own
#: error (which names the server) before cancelling it.
SERVER_ERROR_GRACE_S = 2.0


class WeightUpdateClient(Protocol):
    """What a remote sender needs from an inference client (``RemoteInferenceClient`` fans each call out)."""

    async def get_world_size(self) -> int: ...

    async def init_weight_update_communicator(self, init_info: dict[str, Any]) -> Any: ...

    async def start_weight_update(self) -> Any: ...

    async def update_named_weights(self, update_info: dict[str, Any]) -> Any: ...

    async def finish_weight_update(self, weight_version: int | None = None) -> Any: ...


# ---------------------------------------------------------------- the trainer side, as the control half sees it


@dataclass(frozen=True)
class TransportCall:
    """One operation of a transport half, picklable: ``call(rank, named_weights)`` runs
    ``transport.<op>(rank, named_weights, **arguments)`` on a trainer rank and returns its result (rank 0's is
    the one the control half reads; other ranks return None).

    Any exception is re-raised as a ``WeightTransferError`` (``WeightTransferTimeoutError`` for a timeout)
    whose message names the rank.
    """

    transport: Any
    op: Literal["open", "join", "push", "next", "close"]
    arguments: dict[str, Any] = field(default_factory=dict)

    def __call__(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> Any:
        try:
            return getattr(self.transport, self.op)(rank, named_weights, **self.arguments)
        except WeightTransferError as error:
            if error.rank is not None:  # already names its rank
                raise
            named = type(error)(f"trainer rank {rank}: {error}")
            named.rank = rank
            raise named from error
        except RollflowError as error:  # e.g. a missing extra: its type tells the caller what to do
            error.add_note(f"raised on trainer rank {rank} by the weight transport's {self.op}")
            raise
        except Exception as error:
            kind = WeightTransferTimeoutError if is_timeout(error) else WeightTransferError
            named = kind(
                f"trainer rank {rank}: weight transport {self.op} failed: {type(error).__name__}: {error}"
            )
            named.rank = rank
            raise named from error


class WeightPusher(Protocol):
    """What a trainer handle offers the weight transfer (``Trainer``, ``TrainerProcess``, a worker group,
    ``StaticWeights``)."""

    def push_weights(self, call: Callable[[int, Iterable[tuple[str, Any]]], Any]) -> Any:
        """Run ``call(rank, named_weights)`` on every trainer rank, each with its own named weights (its shards
        for a sharded model), and return rank 0's result; raise what any rank raised. Blocking or async."""
        ...


class WeightSource:
    """Where the weights are, for the control half: a trainer handle (a ``WeightPusher``) whose
    ``push_weights(call)`` runs the transport calls where the weights are, and whose ``named_weights()``
    serves the in-process ``local`` strategy.

    A blocking ``push_weights`` runs in a worker thread (abandoned on cancellation: a collective stuck on a
    dead peer ends at its own timeout); an async one is awaited.
    """

    def __init__(self, trainer: WeightPusher):
        self.trainer = trainer

    async def run(self, call: TransportCall) -> Any:
        """``call`` on every trainer rank; rank 0's result."""
        push = self.trainer.push_weights
        if inspect.iscoroutinefunction(push):
            return await push(call)
        return await anyio.to_thread.run_sync(push, call, abandon_on_cancel=True)

    def named_weights(self) -> Iterable[tuple[str, Any]]:
        """The weights themselves, in this process (the ``local`` strategy only)."""
        return self.trainer.named_weights()


class StaticWeights:
    """A trainer handle over weights held in this process (a checkpoint's, a test's): rank 0 of one.

    Args:
        named_weights: called for every push; returns ``(name, tensor)`` pairs.
    """

    def __init__(self, named_weights: Callable[[], Iterable[tuple[str, Any]]]):
        self._named_weights = named_weights

    def named_weights(self) -> Iterable[tuple[str, Any]]:
        return self._named_weights()

    def push_weights(self, call: Callable[[int, Iterable[tuple[str, Any]]], Any]) -> Any:
        return call(0, self._named_weights())


def as_source(trainer: Any) -> WeightSource:
    """``trainer`` itself when it is a ``WeightSource``, else a ``WeightSource`` over the trainer handle."""
    return trainer if isinstance(trainer, WeightSource) else WeightSource(trainer)


def new_transfer_id() -> str:
    """A fresh key for one connection's trainer-side session (and its store prefix)."""
    return f"rollflow-weights-{secrets.token_hex(8)}"


# ---------------------------------------------------------------- the control half


class WeightSender(abc.ABC):
    """Control half of one strategy, for one connection to the servers.

    Lifecycle: ``await setup(client, source)`` once, ``await push(client, source, version)`` per policy
    version, ``close()`` at the end. After a failed or cancelled push the transfer state is unknown (a
    half-done broadcast), so the sender refuses further pushes; close it and build a new one
    (``connect_sender``).
    """

    def __init__(self, inference_world_size: int):
        self.inference_world_size = inference_world_size
        #: What every server was sent on ``/init_weight_transfer_engine`` (set by ``setup``).
        self.init_info: dict[str, Any] = {}
        #: Why this sender can no longer push (None while it can); ``WeightTransfer`` then reconnects.
        self.broken: str | None = None
        #: The trainer-side session this sender opened, if any; released by the next connection's open.
        self.transfer_id: str | None = None

    @abc.abstractmethod
    async def setup(self, client: Any, source: WeightSource, release: Iterable[str] = ()) -> None:
        """Connect: open the transport on the trainer (which reports its rendezvous) and send ``init_info`` to
        every server. ``release`` names earlier trainer-side sessions to free first.

        Raises:
            WeightTransferError: the servers report another world size, or a server or a trainer rank failed
                (the message names it).
            WeightTransferTimeoutError: the receivers did not join within the strategy's timeout.
        """

    @abc.abstractmethod
    async def push(self, client: Any, source: WeightSource, policy_version: int) -> None:
        """Have the trainer send its weights (Hugging Face state-dict names) to every engine as
        ``policy_version``: start → update (with the trainer's push) → finish over ``client``. The caller
        pauses the engines before and resumes after.

        Raises:
            WeightTransferError: the transfer failed (naming the server or trainer rank), or the sender is
                broken by an earlier failure.
            WeightTransferTimeoutError: the transfer took longer than the strategy's timeout.
        """

    def close(self) -> None:
        """Refuse further pushes, and release the trainer-side session if it lives in this process (an
        in-thread trainer's); one in a trainer process or worker is released by the next connection's open,
        or when that process exits. Idempotent."""
        self.broken = self.broken or "it was closed"
        if self.transfer_id is not None:
            from rollflow.weights.transport import release_sessions

            release_sessions([self.transfer_id])


class WeightTransferStrategy(abc.ABC):
    """How weights travel from trainer to engines; see the module docstring."""

    name: ClassVar[str]

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        """This strategy's keyword options from the ``weight_sync`` section ``sync``, for servers of kind
        ``engine`` (``inference.engine``), with ``master_address`` resolved from ``"auto"``. None by default."""
        return {}

    @abc.abstractmethod
    def create_sender(self, inference_world_size: int) -> WeightSender:
        """A control half for ``inference_world_size`` workers in all (ask the servers with
        ``client.get_world_size()``; never take it from config)."""


def check_transfer_dtype(dtype: str) -> str:
    """``dtype`` when it is one of ``TRANSFER_DTYPES``.

    Raises:
        ValueError: naming ``weight_sync.dtype`` and the choices.
    """
    if dtype not in TRANSFER_DTYPES:
        raise ValueError(f"weight_sync.dtype must be one of {', '.join(TRANSFER_DTYPES)}, got {dtype!r}")
    return dtype


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
        # Trainer-side sessions of closed senders, released by the next connection's open (or by close()
        # when they live in this process).
        self._released: list[str] = []

    async def push(self, client: Any, source: Any, policy_version: int) -> None:
        """Have the trainer behind ``source`` (a ``WeightSource``, or a trainer handle) push its weights as
        ``policy_version`` (engines paused by the caller).

        Raises:
            WeightTransferError, WeightTransferTimeoutError: as ``WeightSender.setup`` and ``push``; the next
                call reconnects.
        """
        source = as_source(source)
        if self.sender is not None and self.sender.broken is not None:
            self._close_sender()
        if self.sender is None:
            release, self._released = self._released, []
            self.sender = await connect_sender(self.strategy, client, source, release=release)
        try:
            await self.sender.push(client, source, policy_version)
        except BaseException:
            # Whatever failed (a timeout, a server error, cancellation), the servers may hold a half-done
            # update: the next push starts over from init_weight_transfer_engine.
            self._close_sender()
            raise

    def _close_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()
            if sender.transfer_id is not None:
                self._released.append(sender.transfer_id)

    def close(self) -> None:
        """Close the current sender (and its trainer-side session when it lives in this process; a trainer
        process or worker releases its own when it exits). Idempotent."""
        self._close_sender()
        self._released = []


async def connect_sender(
    strategy: WeightTransferStrategy, client: Any, source: Any, *, release: Iterable[str] = ()
) -> WeightSender:
    """Ask the servers for their world size, build a sender, and set it up with the trainer behind
    ``source`` (a ``WeightSource``, or a trainer handle).

    Raises:
        WeightTransferError, WeightTransferTimeoutError: as ``WeightSender.setup``.
    """
    source = as_source(source)
    world_size = await client.get_world_size() if hasattr(client, "get_world_size") else 1
    sender = strategy.create_sender(world_size)
    try:
        await sender.setup(client, source, release=release)
    except BaseException:
        sender.close()
        raise
    return sender


async def run_with_servers(
    what: str,
    trainer_side: Callable[[], Awaitable[Any]],
    servers_side: Callable[[], Awaitable[Any]],
    timeout_s: float,
    *,
    servers: Iterable[str] = (),
) -> Any:
    """Run the trainer's side of a transfer and the servers' HTTP call (which blocks on the servers until the
    trainer's side happens) concurrently, within ``timeout_s``; returns the trainer side's result.

    When the trainer side fails, the servers get ``SERVER_ERROR_GRACE_S`` to report their own error, which
    wins (it names the server) unless every server blames the trainer (HTTP 502: its peer failed); the other
    error is attached as a note. When the servers blame the trainer first, the trainer side's own error (which
    names the rank) is awaited, within ``timeout_s``: a worker group reports a rank's failure only once the
    ranks it left stuck in a collective are stopped, after the servers saw their peer go.

    Raises:
        WeightTransferTimeoutError: either side took longer than ``timeout_s`` (the message says which sides
            were still pending, naming ``servers``).
        Exception: the servers' error, else the trainer side's.
    """
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    servers_done = anyio.Event()
    trainer_done = anyio.Event()

    async def run_servers(tg: Any) -> None:
        try:
            await servers_side()
            results["servers"] = True
        except Exception as error:
            errors["servers"] = error
            servers_done.set()
            if _blames_the_trainer(error):
                await trainer_done.wait()
            tg.cancel_scope.cancel()
        finally:
            servers_done.set()

    async def run_trainer(tg: Any) -> None:
        try:
            results["trainer"] = await trainer_side()
        except Exception as error:
            errors["trainer"] = error
            trainer_done.set()
            with anyio.move_on_after(SERVER_ERROR_GRACE_S):
                await servers_done.wait()
            tg.cancel_scope.cancel()
        finally:
            trainer_done.set()

    try:
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_servers, tg)
                tg.start_soon(run_trainer, tg)
    except TimeoutError as error:
        if "servers" in errors and "trainer" not in errors:  # they blamed the trainer, which never answered
            errors["servers"].add_note(f"the trainer side did not finish within {timeout_s:.3g} s")
            raise errors["servers"] from error
        if (
            errors
        ):  # the trainer side failed, and the servers' grace ran into the deadline: report the failure
            raise next(iter(errors.values())) from None
        pending = []
        if "trainer" not in results and "trainer" not in errors:
            pending.append("trainer rank 0")
        if "servers" not in results and "servers" not in errors:
            urls = ", ".join(servers)
            pending.append(f"the servers ({urls})" if urls else "the servers")
        raise WeightTransferTimeoutError(
            f"{what} took longer than {timeout_s:.3g} s; still waiting on {' and '.join(pending) or 'nothing'}"
        ) from error
    if "servers" in errors:
        error = errors["servers"]
        if "trainer" in errors:
            if _blames_the_trainer(error):
                errors["trainer"].add_note(f"the servers report: {error}")
                raise errors["trainer"]
            error.add_note(f"the trainer side failed too: {errors['trainer']}")
        raise error
    if "trainer" in errors:
        raise errors["trainer"]
    return results["trainer"]


async def run_update_round(
    sender: WeightSender,
    client: Any,
    how: str,
    trainer_push: Callable[[], Awaitable[Any]],
    update_info: Any,
    policy_version: int,
    timeout_s: float,
) -> Any:
    """One update of a collective transfer: ``/start_weight_update``, then ``/update_weights`` together with
    the trainer's push, then ``/finish_weight_update`` labelling ``policy_version``; all within ``timeout_s``.
    Any failure marks ``sender`` broken: the group may be mid-bucket. Returns the trainer side's result.

    Raises:
        WeightTransferTimeoutError: the round took longer than ``timeout_s`` (naming the step, and the servers
            or trainer rank it was waiting on).
        WeightTransferError, ControlPlaneError: a trainer rank or a server failed (named).
    """
    servers = getattr(client, "server_urls", ())
    what = f"pushing policy version {policy_version} ({how})"
    deadline = anyio.current_time() + timeout_s

    def remaining() -> float:
        return max(0.0, deadline - anyio.current_time())

    try:
        await servers_step(
            f"{what}: /start_weight_update", client.start_weight_update(), remaining(), servers
        )
        result = await run_with_servers(
            what, trainer_push, lambda: client.update_named_weights(update_info), remaining(), servers=servers
        )
        await servers_step(
            f"{what}: /finish_weight_update",
            client.finish_weight_update(weight_version=policy_version),
            remaining(),
            servers,
        )
    except TimeoutError:
        sender.broken = f"policy version {policy_version} timed out mid-transfer"
        raise
    except BaseException as exc:
        sender.broken = f"pushing policy version {policy_version} failed ({type(exc).__name__})"
        raise
    return result


async def servers_step(what: str, call: Awaitable[Any], timeout_s: float, servers: Iterable[str] = ()) -> Any:
    """``await call`` (an HTTP fan-out to the servers) within ``timeout_s``.

    Raises:
        WeightTransferTimeoutError: naming ``what`` and ``servers``.
    """
    try:
        with anyio.fail_after(timeout_s):
            return await call
    except TimeoutError as exc:
        urls = ", ".join(servers)
        raise WeightTransferTimeoutError(
            f"{what} took longer than {timeout_s:.3g} s; still waiting on the servers{f' ({urls})' if urls else ''}"
        ) from exc


async def init_servers(sender: WeightSender, client: Any, what: str, timeout_s: float) -> None:
    """Send ``sender.init_info`` to every server (``/init_weight_transfer_engine``) within ``timeout_s``.

    Raises:
        WeightTransferTimeoutError: naming ``what`` (the sender is then broken).
    """
    try:
        with anyio.fail_after(timeout_s):
            await client.init_weight_update_communicator(sender.init_info)
    except TimeoutError as exc:
        sender.broken = "the servers never initialized"
        raise WeightTransferTimeoutError(
            f"initializing the {what} transfer on the servers took longer than {timeout_s:g} s"
        ) from exc


def _blames_the_trainer(error: BaseException) -> bool:
    """Whether every server that failed answered 502: the transfer's peer (the trainer side) failed."""
    failures = getattr(error, "failures", None)
    return bool(failures) and all(getattr(f, "status", None) == 502 for f in failures.values())


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is (or reads as) a timeout: torch.distributed raises several kinds."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


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
