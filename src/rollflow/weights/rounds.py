"""The steps of a transfer that talk to the servers, each bounded and naming what it waited on.

``run_with_servers`` runs the trainer's side and the servers' HTTP call together (a collective needs both);
``run_update_round`` is one start ▸ update ▸ finish round of a collective transfer; ``open_transport``,
``check_world_size`` and ``init_servers`` are the connect steps. Torch-free: the orchestrator runs these.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from rollflow.errors import WeightTransferError, WeightTransferTimeoutError
from rollflow.weights.base import SERVER_ERROR_GRACE_S, TransportCall, WeightSender, WeightSource

if TYPE_CHECKING:
    from rollflow.inference.control import ControlPlane, WirePayload


async def check_world_size(sender: WeightSender, control: ControlPlane, world_size: int) -> None:
    """Fail (and mark ``sender`` broken) unless the servers report ``world_size - 1`` workers.

    Raises:
        WeightTransferError: the servers report another world size.
    """
    inference_world_size = (await control.world_size()).total_workers
    if inference_world_size + 1 != world_size:
        sender.broken = "its world size does not match the servers'"
        raise WeightTransferError(
            f"the inference servers report {inference_world_size} workers but this sender was made for "
            f"{world_size - 1} (world_size {world_size} includes the trainer); "
            "create it from client.get_world_size()"
        )


async def open_transport(
    sender: WeightSender, source: WeightSource, call: TransportCall, timeout_s: float
) -> Any:
    """Run ``call`` (an ``open``) on the trainer within ``timeout_s``; rank 0's report.

    Raises:
        WeightTransferTimeoutError: the trainer did not answer in time.
        WeightTransferError: a trainer rank failed (named).
    """
    try:
        with anyio.fail_after(timeout_s):
            return await source.run(call)
    except TimeoutError as exc:
        sender.broken = "its transport never opened"
        raise WeightTransferTimeoutError(
            f"opening the weight transport on trainer rank 0 took longer than {timeout_s:g} s"
        ) from exc
    except BaseException:
        sender.broken = "its transport never opened"
        raise


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

    async def run_servers(tg: anyio.abc.TaskGroup) -> None:
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

    async def run_trainer(tg: anyio.abc.TaskGroup) -> None:
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
    control: ControlPlane,
    how: str,
    trainer_push: Callable[[], Awaitable[Any]],
    update_info: WirePayload | Sequence[WirePayload],
    policy_version: int,
    timeout_s: float,
) -> Any:
    """One update of a collective transfer: ``/start_weight_update``, then ``/update_weights`` together with
    the trainer's push, then ``/finish_weight_update`` labelling ``policy_version``; all within ``timeout_s``.
    Returns the trainer side's result (the sender's ``push`` template marks it broken on any failure).

    Raises:
        WeightTransferTimeoutError: the round took longer than ``timeout_s`` (naming the step, and the servers
            or trainer rank it was waiting on).
        WeightTransferError, ControlPlaneError: a trainer rank or a server failed (named).
    """
    servers = control.server_urls
    what = f"pushing policy version {policy_version} ({how})"
    deadline = anyio.current_time() + timeout_s

    def remaining() -> float:
        return max(0.0, deadline - anyio.current_time())

    await servers_step(f"{what}: /start_weight_update", control.start_weight_update(), remaining(), servers)
    result = await run_with_servers(
        what, trainer_push, lambda: control.update_weights(update_info), remaining(), servers=servers
    )
    await servers_step(
        f"{what}: /finish_weight_update",
        control.finish_weight_update(policy_version),
        remaining(),
        servers,
    )
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


async def init_servers(sender: WeightSender, control: ControlPlane, what: str, timeout_s: float) -> None:
    """Send ``sender.init_info`` to every server (``/init_weight_transfer_engine``) within ``timeout_s``.

    Raises:
        WeightTransferTimeoutError: naming ``what`` (the sender is then broken).
    """
    try:
        with anyio.fail_after(timeout_s):
            await control.init_weight_transfer([sender.init_info])
    except TimeoutError as exc:
        sender.broken = "the servers never initialized"
        raise WeightTransferTimeoutError(
            f"initializing the {what} transfer on the servers took longer than {timeout_s:g} s"
        ) from exc


def _blames_the_trainer(error: BaseException) -> bool:
    """Whether every server that failed answered 502: the transfer's peer (the trainer side) failed."""
    failures = getattr(error, "failures", None)
    return bool(failures) and all(getattr(f, "status", None) == 502 for f in failures.values())
