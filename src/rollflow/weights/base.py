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
  (``rollflow.weights.trainer.sessions``), keyed by the spec's ``transfer_id``.
- the **receiver** (engine-server side, ``rollflow.weights.server.receiver``): built from ``init_info`` by
  ``/init_weight_transfer_engine``; each ``/update_weights`` turns one ``update_info`` into named tensors.

The caller (the weight barrier) pauses and resumes the engines around a push; a strategy never does.

``init_info`` and ``update_info`` are msgspec Structs (``rollflow.weights.payloads``) using vLLM's field names
where vLLM has them (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``names``,
``dtype_names``, ``shapes``), plus ``backend`` (which receiver to build, the union's tag) and ``policy_version``
(a repeat of ``/finish_weight_update``'s ``weight_version``). ``encode_for(engine)`` gives their JSON: for vLLM
servers (``engine="vllm"``) vLLM 0.33's keys only, since vLLM rejects unknown ones. rollflow's own receivers
decode both shapes.

This module stays free of torch so configuration and the orchestrator can import it cheaply.
"""

from __future__ import annotations

import abc
import inspect
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import anyio
import structlog

from rollflow.errors import (
    RollflowError,
    WeightTransferError,
    WeightTransferTimeoutError,
)
from rollflow.weights.payloads import RECEIVER_BACKENDS as RECEIVER_BACKENDS  # re-exported
from rollflow.weights.registry import strategy_names

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)

#: Strategy names accepted by ``create_strategy`` (those registered in ``rollflow.weights.registry``).
STRATEGIES: tuple[str, ...] = strategy_names()

#: Dtypes weights may be cast to on the trainer side before they travel (``weight_sync.dtype``).
TRANSFER_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")

#: How long the control half waits, after the trainer side failed, for the servers' side to report its own
#: error (which names the server) before cancelling it.
SERVER_ERROR_GRACE_S = 2.0


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

    @property
    def can_probe(self) -> bool:
        """Whether the trainer computes value probes (``TrainerHandle.probe_logprobs``; ``StaticWeights``
        does not)."""
        return hasattr(self.trainer, "probe_logprobs")

    async def probe_logprobs(self, token_ids: Sequence[int], start: int) -> list[float]:
        """The trainer's logprob of each of ``token_ids[start:]`` after the ones before it
        (``TrainerHandle.probe_logprobs``), in a worker thread unless it is async."""
        probe = self.trainer.probe_logprobs  # type: ignore[attr-defined]
        if inspect.iscoroutinefunction(probe):
            return await probe(token_ids, start)
        return await anyio.to_thread.run_sync(probe, token_ids, start, abandon_on_cancel=True)


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


def as_source(trainer: WeightSource | WeightPusher) -> WeightSource:
    """``trainer`` itself when it is a ``WeightSource``, else a ``WeightSource`` over the trainer handle."""
    return trainer if isinstance(trainer, WeightSource) else WeightSource(trainer)


def new_transfer_id() -> str:
    """A fresh key for one connection's trainer-side session (and its store prefix)."""
    return f"rollflow-weights-{secrets.token_hex(8)}"


# ---------------------------------------------------------------- the control half


class WeightSender(abc.ABC):
    """Control half of one strategy, for one connection to the servers: the one sender template.

    Lifecycle: ``await setup(control, source)`` once, ``await push(control, source, version)`` per policy
    version, ``close()`` at the end. After a failed or cancelled setup or push the transfer state is unknown (a
    half-done broadcast), so the sender refuses further pushes; close it and build a new one
    (``connect_sender``). This class keeps that bookkeeping (``broken``) and the push's deadline; a strategy
    writes only ``_connect`` and ``_push``.
    """

    #: How messages name this sender ("broadcast", "checkpoint", "CUDA IPC" …).
    label: ClassVar[str]
    #: How the push travels, for the timeout message ("as a checkpoint", "by CUDA IPC").
    how: ClassVar[str] = ""
    #: True when ``_push`` bounds itself by ``timeout_s`` (a collective round naming the step it waited on);
    #: else the template bounds it.
    bounds_itself: ClassVar[bool] = False

    def __init__(self, inference_world_size: int, timeout_s: float = 300.0):
        self.inference_world_size = inference_world_size
        self.timeout_s = timeout_s
        #: What every server was sent on ``/init_weight_transfer_engine`` (set by ``setup``).
        self.init_info: dict[str, Any] = {}
        #: Why this sender can no longer push (None while it can); ``WeightTransfer`` then reconnects.
        self.broken: str | None = None
        #: The trainer-side session this sender opened, if any; released by the next connection's open.
        self.transfer_id: str | None = None
        #: Seconds the last push's proof of delivery took (``rollflow.weights.delivery``); None for a sender
        #: that checks none.
        self.delivery_check_s: float | None = None
        #: The largest mean |logprob difference| between a server and the trainer on the last ``verify``'s
        #: probe; None for a sender that probes none.
        self.probe_logprob_diff: float | None = None

    async def setup(self, control: ControlPlane, source: WeightSource, release: Iterable[str] = ()) -> None:
        """Connect: open the transport on the trainer (which reports its rendezvous) and send ``init_info`` to
        every server. ``release`` names earlier trainer-side sessions to free first.

        Raises:
            WeightTransferError: the servers report another world size, or a server or a trainer rank failed
                (the message names it).
            WeightTransferTimeoutError: the receivers did not join within the strategy's timeout.
        """
        try:
            await self._connect(control, as_source(source), release)
        except BaseException:
            self.broken = self.broken or "it never connected"
            raise

    async def push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        """Have the trainer send its weights (Hugging Face state-dict names) to every engine as
        ``policy_version``: start → update (with the trainer's push) → finish over ``control``. The caller
        pauses the engines before and resumes after.

        Raises:
            WeightTransferError: the transfer failed (naming the server or trainer rank), or the sender is
                broken by an earlier failure.
            WeightTransferTimeoutError: the transfer took longer than the strategy's timeout.
        """
        if self.broken is not None:
            raise WeightTransferError(
                f"this {self.label} sender is unusable: {self.broken}; close it and reconnect"
            )
        source = as_source(source)
        try:
            if self.bounds_itself:
                await self._push(control, source, policy_version)
            else:
                with anyio.fail_after(self.timeout_s):
                    await self._push(control, source, policy_version)
        except WeightTransferTimeoutError:
            self.broken = f"policy version {policy_version} timed out mid-transfer"
            raise
        except TimeoutError as exc:
            self.broken = f"policy version {policy_version} timed out"
            raise WeightTransferTimeoutError(
                f"pushing policy version {policy_version} {self.how} took longer than {self.timeout_s:g} s"
            ) from exc
        except BaseException as exc:
            # A server may hold a started update; the next push starts over from init.
            self.broken = f"pushing policy version {policy_version} failed ({type(exc).__name__})"
            raise

    async def verify(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        """After the engines resumed on ``policy_version``: check the values they compute with it, for a
        sender whose servers report no digest of what they hold. None by default (``push`` proved delivery).

        Raises:
            WeightTransferError: a server computes other values than the trainer's weights (naming it).
        """
        return None

    @abc.abstractmethod
    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        """``setup``'s work; any failure marks the sender broken."""

    @abc.abstractmethod
    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        """``push``'s work, on a sender that is not broken; any failure marks it broken."""

    def close(self) -> None:
        """Refuse further pushes, and release the trainer-side session if it lives in this process (an
        in-thread trainer's); one in a trainer process or worker is released by the next connection's open,
        or when that process exits. Idempotent."""
        self.broken = self.broken or "it was closed"
        if self.transfer_id is not None:
            from rollflow.weights.trainer.sessions import release_sessions

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
        ``control.world_size()``; never take it from config)."""


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

    async def push(
        self, control: ControlPlane, source: WeightSource | WeightPusher, policy_version: int
    ) -> None:
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
            self.sender = await connect_sender(self.strategy, control, source, release=release)
        try:
            await self.sender.push(control, source, policy_version)
        except BaseException:
            # Whatever failed (a timeout, a server error, cancellation), the servers may hold a half-done
            # update: the next push starts over from init_weight_transfer_engine.
            self._close_sender()
            raise

    async def verify(
        self, control: ControlPlane, source: WeightSource | WeightPusher, policy_version: int
    ) -> None:
        """The sender's value check of the push just made (``WeightSender.verify``), once the engines resumed.

        Raises:
            WeightTransferError: as ``WeightSender.verify``.
        """
        if self.sender is not None:
            await self.sender.verify(control, as_source(source), policy_version)

    @property
    def delivery_check_s(self) -> float | None:
        """Seconds the last push's proof of delivery took, None when the sender checks none (or none yet)."""
        return None if self.sender is None else self.sender.delivery_check_s

    @property
    def probe_logprob_diff(self) -> float | None:
        """The last ``verify``'s largest mean |logprob difference| from the trainer's, None without one."""
        return None if self.sender is None else self.sender.probe_logprob_diff

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
    strategy: WeightTransferStrategy,
    control: ControlPlane,
    source: WeightSource | WeightPusher,
    *,
    release: Iterable[str] = (),
) -> WeightSender:
    """Ask the servers for their world size, build a sender, and set it up with the trainer behind
    ``source`` (a ``WeightSource``, or a trainer handle).

    Raises:
        WeightTransferError, WeightTransferTimeoutError: as ``WeightSender.setup``.
    """
    source = as_source(source)
    world = await control.world_size()
    sender = strategy.create_sender(world.total_workers)
    try:
        await sender.setup(control, source, release=release)
    except BaseException:
        sender.close()
        raise
    return sender


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is (or reads as) a timeout: torch.distributed raises several kinds."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text
