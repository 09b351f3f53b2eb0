"""The engine server's weight-receive state machine, apart from HTTP: what each weight-transfer call may do now.

vLLM 0.33's lifecycle: ``init`` builds a receiver once per connection; then per policy version ``start`` ▸
``update`` (one or more) ▸ ``finish``. Three pieces of state make it safe against a trainer that fails or
reconnects mid-round:

- the **epoch**: each ``init`` starts a new transfer session. A receive blocked on a peer that died must not
  hold the server hostage: it runs outside the lock, a newer init supersedes it (its round is abandoned), and
  whatever it returns late is discarded, its receiver closed;
- the **version floor**: the newest policy version loaded since ``init``; an older one is refused (409), since
  per-token versions would go backwards. A new ``init`` (a new trainer, a resumed run) starts over;
- the **round**: ``start`` opens one (a second ``start`` in the same epoch is refused), a failed receive or a
  refused load ends it, ``finish`` closes it.

The server's handlers call this class and answer its ``WeightReceiveError`` with the status its ``kind`` names
(``invalid`` 400, ``conflict`` 409, ``failed`` 502); the texts are the ones clients see.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import structlog

from rollflow.errors import WeightReceiveError
from rollflow.weights.ranks import FIRST_WORKER_RANK, update_list_index

log = structlog.get_logger(__name__)

#: One ``update_info`` as a server receives it, or vLLM's list of them indexed by global worker rank.
UpdateInfoBody = Mapping[str, Any] | list[Mapping[str, Any]]


class Receiver(Protocol):
    """What an init builds (``rollflow.weights.server.receiver.create_receiver``); both calls block."""

    def receive(self, update_info: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """One update's named tensors (Hugging Face state-dict names)."""
        ...

    def close(self) -> None:
        """Release what the receiver holds (a process group). Idempotent."""
        ...


#: ``(init_info, worker_rank) -> receiver``; blocking (a broadcast joins its group).
ReceiverFactory = Callable[[dict[str, Any], int], Receiver]
#: What ``update`` hands the received tensors to, under the lock: ``load(tensors, policy_version)``.
LoadWeights = Callable[[list[tuple[str, Any]], int], Awaitable[None]]


def close_quietly(receiver: object) -> None:
    """``receiver.close()``, a failure logged: a receiver nobody uses any more."""
    close = getattr(receiver, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            log.exception("closing an unused weight receiver failed")


def in_daemon_thread(function: Callable[..., Any], *args: Any) -> asyncio.Future:
    """A future of ``function(*args)`` run in a new daemon thread. Unlike ``asyncio.to_thread`` it holds no
    worker of the loop's executor, so a call that blocks for good (a peer that never answers) costs one idle
    thread, not the executor the server's other blocking work needs."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:  # handed to the future
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            if error is None:
                close_quietly(result)

    threading.Thread(target=run, name="rollflow-weight-init", daemon=True).start()
    return future


def _close_late_receiver(building: asyncio.Future) -> None:
    """Close the receiver an init that timed out built after all (in a thread: closing may block)."""
    if building.cancelled() or building.exception() is not None:
        return
    threading.Thread(target=close_quietly, args=(building.result(),), daemon=True).start()


class WeightReceiveState:
    """One engine server's weight-transfer session (see the module docstring). Every method is a coroutine of
    the server's event loop; blocking work (building a receiver, receiving) runs in threads.

    Args:
        receiver_factory: builds the receiver of an ``init_info`` (``create_receiver``; a fake in tests).
        worker_rank: this server's worker index (0 for a single-worker torch server).
    """

    def __init__(self, receiver_factory: ReceiverFactory, worker_rank: int = 0):
        self.receiver_factory = receiver_factory
        self.worker_rank = worker_rank
        self._lock = asyncio.Lock()
        self._receiver: Receiver | None = None
        self._init_info: dict[str, Any] = {}
        #: Bumped by every init: an update or receive of an older epoch was superseded.
        self.epoch = 0
        self._update_active = False
        self._update_epoch = 0  # the epoch the active round was started in
        self._pending_version = 0
        #: The newest policy version loaded since the latest init (None: none yet); older ones are refused.
        self.version_floor: int | None = None
        self._receive_lock = asyncio.Lock()
        self._receive_in_flight = False

    @property
    def has_receiver(self) -> bool:
        """Whether an init has installed a receiver (and no shutdown closed it)."""
        return self._receiver is not None

    @property
    def update_active(self) -> bool:
        """Whether a round is open (``start`` called, no ``finish`` or failure since)."""
        return self._update_active

    # ------------------------------------------------------------------ init and shutdown

    async def init(self, init_info: dict[str, Any], timeout_s: float) -> None:
        """Start a new epoch and build its receiver from ``init_info``, replacing the old one, all within
        ``timeout_s``. The construction runs outside the lock, so other weight calls and a newer init are never
        held behind it; a receiver it returns late (after the deadline, or once superseded) is closed.

        Raises:
            WeightReceiveError: ``invalid`` for a bad ``init_info``; ``failed`` when the receiver could not be
                built (the trainer's group did not form) or not within ``timeout_s``; ``conflict`` when a later
                init superseded this one while it was building.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def timed_out(what: str) -> WeightReceiveError:
            # The trainer side (the upstream peer) did not answer in time, not this request's fault.
            return WeightReceiveError(
                "failed",
                f"weight transfer init did not complete within init_info.timeout_s = {timeout_s:g} s ({what}); "
                "check that the trainer side is running and reachable, or raise weight_sync.timeout_s",
                "init_info",
            )

        try:
            async with asyncio.timeout_at(deadline), self._lock:
                if self._receive_in_flight:
                    # The blocked receive owns the old receiver and closes it when it returns; its round is
                    # abandoned.
                    self._receiver = None
                    self._update_active = False
                else:
                    await self._close_receiver()
                self.epoch += 1
                epoch = self.epoch
                self.version_floor = None
                self._receive_lock = asyncio.Lock()
                self._receive_in_flight = False
        except TimeoutError:
            raise timed_out("waiting for another weight call, or closing the previous receiver") from None
        # Blocking, and may join a torch.distributed group: off the event loop, outside the lock, and in a
        # thread of its own (one that never returns must not take a worker of the loop's executor).
        building = in_daemon_thread(self.receiver_factory, init_info, self.worker_rank)
        try:
            async with asyncio.timeout_at(deadline):
                receiver = await asyncio.shield(building)
        except TimeoutError as error:
            failed = None if not building.done() or building.cancelled() else building.exception()
            if isinstance(failed, TimeoutError):  # the receiver's own deadline
                raise timed_out(str(failed)) from None
            # This call's deadline: whatever the construction returns later is closed.
            building.add_done_callback(_close_late_receiver)
            log.warning("weight transfer init timed out", timeout_s=timeout_s, error=repr(error))
            raise timed_out("the receiver was not ready") from None
        except (ValueError, TypeError, KeyError) as error:
            raise WeightReceiveError("invalid", f"invalid init_info: {error}", "init_info") from None
        except Exception as error:  # the trainer's group did not form: a failure, named
            log.exception("weight transfer init failed")
            raise WeightReceiveError(
                "failed", f"weight transfer init failed: {type(error).__name__}: {error}"
            ) from None
        async with self._lock:
            if epoch != self.epoch:
                await asyncio.to_thread(close_quietly, receiver)
                raise WeightReceiveError(
                    "conflict",
                    "a later init_weight_transfer_engine superseded this one while its receiver was being "
                    "built; the later one is in force",
                )
            self._receiver = receiver
            self._init_info = init_info

    async def shutdown(self) -> None:
        """Close the receiver and end any open round (``/shutdown_weight_transfer_engine``)."""
        async with self._lock:
            await self._close_receiver()
            self._update_active = False

    async def close(self) -> None:
        """Close the receiver (the server is going away). Idempotent."""
        await self._close_receiver()

    async def _close_receiver(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None and hasattr(receiver, "close"):
            try:
                await asyncio.to_thread(receiver.close)
            except Exception:
                log.exception("closing the weight receiver failed")

    # ------------------------------------------------------------------ one round

    async def start(self, loaded_version: int) -> None:
        """Open a round; an update without a ``policy_version`` of its own loads ``loaded_version + 1``.

        Raises:
            WeightReceiveError: ``invalid`` when a round of this epoch is open already. One started before the
                latest init was abandoned by the trainer (it failed on another server, or on the trainer's
                side, and the trainer reconnected), so it does not count.
        """
        async with self._lock:
            if self._update_active and self._update_epoch == self.epoch:
                raise WeightReceiveError(
                    "invalid",
                    "start_weight_update was already called; call finish_weight_update before starting another",
                )
            self._update_active = True
            self._update_epoch = self.epoch
            self._pending_version = loaded_version + 1

    async def update(self, update_info: UpdateInfoBody, load: LoadWeights) -> int:
        """Receive one round of weights (``update_info``: one payload, or vLLM's list indexed by global worker
        rank), then, under the lock, ``await load(tensors, policy_version)``. Returns the policy version loaded.

        The tensors are received before the version is checked: the trainer's broadcast needs every receiver,
        refused or not. ``load`` may raise to refuse them (the round stays open), or call ``end_round`` first
        to end the round too.

        Raises:
            WeightReceiveError: ``invalid``: no round or no receiver, a bad ``update_info``; ``failed``: the
                receive failed or timed out (the round ends); ``conflict``: a newer init superseded this update
                while it was receiving, or its version is below the floor.
            Exception: what ``load`` raises.
        """
        async with self._lock:
            if not self._update_active:
                raise WeightReceiveError(
                    "invalid", "start_weight_update must be called before update_weights."
                )
            if self._receiver is None:
                raise WeightReceiveError(
                    "invalid", "init_weight_transfer_engine must be called before update_weights."
                )
            info = self._own_entry(update_info)
            version = info.get("policy_version", self._pending_version)
            if isinstance(version, bool) or not isinstance(version, int):
                raise WeightReceiveError(
                    "invalid",
                    f"update_info.policy_version must be an integer, got {version!r}",
                    "update_info",
                )
            receiver, epoch, receive_lock = self._receiver, self.epoch, self._receive_lock
        async with receive_lock:
            tensors = await self._receive(receiver, epoch, info)
        async with self._lock:
            if epoch != self.epoch:
                raise WeightReceiveError(
                    "conflict",
                    "weight transfer was re-initialized while this update was receiving; "
                    "its tensors were discarded",
                )
            self._check_not_older(version, "update_info.policy_version")
            await load(tensors, version)
            self._pending_version = version
            self.version_floor = version
        return version

    def end_round(self) -> None:
        """End the open round without loading (``load`` refused the tensors: the trainer starts a new one).
        Only from inside ``update``'s ``load``, which holds the lock."""
        self._update_active = False

    async def finish(self, policy_version: int | None, label: Callable[[int], Awaitable[None]]) -> None:
        """Close the round; with ``policy_version`` (the wire's ``weight_version``) first ``await
        label(policy_version)`` under the lock (the server relabels its weights) and raise the floor to it.

        Raises:
            WeightReceiveError: ``invalid`` when no round is open; ``conflict`` when ``policy_version`` is
                below the floor.
        """
        async with self._lock:
            if not self._update_active:
                raise WeightReceiveError(
                    "invalid", "start_weight_update must be called before finish_weight_update."
                )
            if policy_version is not None:
                self._check_not_older(policy_version, "weight_version")
                await label(policy_version)
                self.version_floor = policy_version
            self._update_active = False

    def _own_entry(self, update_info: UpdateInfoBody) -> Mapping[str, Any]:
        """This worker's entry of vLLM's list form (one per global inference worker; a single-worker server
        follows the trainer at ``rank_offset``), or ``update_info`` itself."""
        if not isinstance(update_info, list):
            return update_info
        index = update_list_index(int(self._init_info.get("rank_offset", FIRST_WORKER_RANK)))
        if not 0 <= index < len(update_info):
            raise WeightReceiveError(
                "invalid",
                f"update_info is a list of {len(update_info)} but this worker's global index is "
                f"{index} (init_info.rank_offset - 1)",
                "update_info",
            )
        return update_info[index]

    def _check_not_older(self, version: int, param: str) -> None:
        """Refuse a policy version below one loaded in this epoch: per-token versions would go backwards."""
        floor = self.version_floor
        if floor is not None and version < floor:
            raise WeightReceiveError(
                "conflict",
                f"{param} = {version} is older than policy version {floor}, already loaded since "
                "init_weight_transfer_engine; versions only go forward within one transfer session (a new "
                "init_weight_transfer_engine starts another)",
                param.split(".", 1)[0],
            )

    async def _receive(
        self, receiver: Receiver, epoch: int, update_info: Mapping[str, Any]
    ) -> list[tuple[str, Any]]:
        """The blocking receive, off the loop and outside the lock."""
        self._receive_in_flight = True
        try:
            return await asyncio.to_thread(receiver.receive, update_info)
        except (ValueError, TypeError, KeyError) as error:
            raise WeightReceiveError("invalid", f"invalid update_info: {error}", "update_info") from None
        except Exception as error:  # a broken or timed-out transfer: a failure, named
            log.exception("weight transfer failed")
            if epoch == self.epoch:
                self._update_active = False  # the round failed; the trainer starts a new one
            # The transfer's peers (trainer, other workers) failed, not this request.
            raise WeightReceiveError(
                "failed", f"weight transfer failed: {type(error).__name__}: {error}"
            ) from None
        finally:
            if epoch == self.epoch:
                self._receive_in_flight = False
            elif hasattr(receiver, "close"):
                # Superseded while receiving: nobody else holds this receiver any more.
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(receiver.close)
