"""The router as a control plane: vLLM's control endpoints sent to the router fan out to every live worker.

This is what makes "proxy only" work with a rollflow router as the proxy (the client's ``server_urls`` is then
just the router, SkyRL's "the proxy is also the control plane" case). Each call goes to every healthy worker
at once, with the caller's query, body and ``Authorization`` header. The answer combines the workers' answers
in vLLM's shape (below) and adds ``"workers": {url: body}``, and ``"skipped": {url: why}`` for the workers
left out as unhealthy (a weight update they miss keeps them out as stale when they return, so the call
succeeds, but the caller sees who did not get it, and the router logs it); if any worker fails, the answer is an error that
names each failing worker (its 4xx status when all failures share it, else 502), and the others keep what
they did (a partly paused fleet is the caller's to resume).

Combined answers:
- ``/get_world_size``: the **sum** of the workers' sizes, so a client that counts the router as one server
  still gets the total a broadcast must reach. Each worker counts as its own deployment: for vLLM data
  parallelism with one server per DP rank, give the servers to the client instead (``data_parallel_size``).
- ``/is_paused``, ``/is_sleeping``, ``/reset_prefix_cache``: true only when true on every worker.
- ``/abort_requests``: the sum of ``aborted``. ``/wake_up``: ``"awake"`` only when every worker is.
- ``/weight_info``: the common ``weight_version``, or null while the workers differ.
- Others (pause, resume, sleep, weight transfer): the first worker's answer.

``/init_weight_transfer_engine`` with a process-group ``init_info`` (one with ``rank_offset``): every worker
needs its own ranks, so the router asks each worker's world size and rewrites ``rank_offset`` per worker, in
worker order: ``rank_offset``, ``rank_offset + size_0``, … It refuses (400) a list of per-server payloads
(the router assigns the offsets) and an ``init_info.world_size`` too small for the workers' ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from rollflow.http.errors import json_error
from rollflow.weights.ranks import offsets_after

if TYPE_CHECKING:
    from rollflow.inference.router import InferenceRouter
    from rollflow.inference.router_workers import RouterWorker

_log = structlog.get_logger("rollflow.inference.router")

CONTROL_POST = (
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/abort_requests",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
CONTROL_GET = ("/is_paused", "/is_sleeping", "/get_world_size", "/weight_info")
INIT_PATH = "/init_weight_transfer_engine"

Combiner = Callable[[list[dict[str, Any]]], dict[str, Any]]


def _all_true(key: str) -> Combiner:
    return lambda bodies: {key: all(bool(body.get(key)) for body in bodies)}


def _common_version(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    versions = {str(body.get("weight_version")) for body in bodies}
    return {"weight_version": versions.pop() if len(versions) == 1 else None}


def _wake_up(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    awake = all(body.get("status", "awake") == "awake" for body in bodies)
    return {**bodies[0], "status": "awake" if awake else "sleeping"}


COMBINERS: dict[str, Combiner] = {
    "/get_world_size": lambda bodies: {"world_size": sum(int(body["world_size"]) for body in bodies)},
    "/is_paused": _all_true("is_paused"),
    "/is_sleeping": _all_true("is_sleeping"),
    "/reset_prefix_cache": _all_true("success"),
    "/abort_requests": lambda bodies: {
        "status": "aborted",
        "aborted": sum(int(body.get("aborted", 0)) for body in bodies),
    },
    "/wake_up": _wake_up,
    "/weight_info": _common_version,
}


class _Failure(Exception):
    """One worker's failed answer: its status (None when it could not be reached) and message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status


class _Call(msgspec.Struct, frozen=True):
    """One control call as the router sends it to each worker."""

    method: str
    path_qs: str
    headers: dict[str, str]


async def _call(router: InferenceRouter, worker: RouterWorker, call: _Call, body: bytes) -> Any:
    """``call`` on ``worker``; its decoded JSON body ({} when empty).

    Raises:
        _Failure: an error status, a body that is not JSON, or no connection (the worker is then marked dead).
    """
    assert router._client is not None
    try:
        async with router._client.request(
            call.method, f"{worker.url}{call.path_qs}", data=body or None, headers=call.headers
        ) as response:
            raw = await response.read()
            status = response.status
    except aiohttp.ClientConnectorError as error:
        router._mark_dead(worker, f"control call could not connect: {error}")
        raise _Failure(None, f"unreachable: {error}") from None
    except (aiohttp.ClientError, TimeoutError) as error:
        raise _Failure(None, f"failed: {error!r}") from None
    try:
        decoded = msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError:
        decoded = None
    if status >= 400:
        error = decoded.get("error") if isinstance(decoded, dict) else None
        message = error.get("message", error) if isinstance(error, dict) else error
        raise _Failure(status, f"HTTP {status}: {message or raw[:300].decode(errors='replace')}")
    if decoded is None:
        raise _Failure(None, f"answered HTTP {status} with a body that is not JSON")
    return decoded


async def _fan_out(
    router: InferenceRouter, workers: list[RouterWorker], call: _Call, bodies: list[bytes]
) -> list[Any] | web.Response:
    """``call`` on every worker at once (worker ``i`` gets ``bodies[i]``); their answers, or the error."""
    results = await asyncio.gather(
        *(_call(router, worker, call, body) for worker, body in zip(workers, bodies, strict=True)),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, _Failure):
            raise result  # a bug or cancellation, not a worker's answer
    failures = {w.url: r for w, r in zip(workers, results, strict=True) if isinstance(r, _Failure)}
    if not failures:
        return list(results)
    statuses = {failure.status for failure in failures.values()}
    status = statuses.pop() if len(statuses) == 1 else None
    # The callers' own mistakes (every worker says the same 4xx) stay 4xx; anything else is upstream: 502.
    status = status if status is not None and 400 <= status < 500 else 502
    path = call.path_qs.split("?", 1)[0]
    lines = "; ".join(f"{url}: {failure}" for url, failure in failures.items())
    return json_error(
        status, f"{call.method} {path} failed on {len(failures)} of {len(workers)} worker(s): {lines}"
    )


async def _init_bodies(
    router: InferenceRouter, workers: list[RouterWorker], headers: dict[str, str], raw: bytes
) -> list[bytes] | web.Response:
    """Per-worker bodies of ``/init_weight_transfer_engine``: ``rank_offset`` advanced by the sizes of the
    workers before (process-group payloads); other payloads go to every worker unchanged."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as error:
        return json_error(400, f"request body is not valid JSON: {error}")
    info = body.get("init_info") if isinstance(body, dict) else None
    if isinstance(info, list):
        return json_error(
            400,
            "send one init_info to a router, not a list per server: the router gives each of its "
            f"{len(workers)} worker(s) its own rank_offset",
            param="init_info",
        )
    if not isinstance(info, dict) or "rank_offset" not in info:
        return [raw] * len(workers)
    first, world_size = info.get("rank_offset"), info.get("world_size")
    if not (_is_int(first) and _is_int(world_size) and first >= 1):
        return json_error(
            400,
            f"init_info.rank_offset ({first!r}) must be an integer >= 1 and init_info.world_size "
            f"({world_size!r}) an integer",
            param="init_info",
        )
    sizes = await _fan_out(router, workers, _Call("GET", "/get_world_size", headers), [b""] * len(workers))
    if isinstance(sizes, web.Response):
        return sizes
    worker_sizes = []
    for worker, size in zip(workers, sizes, strict=True):
        try:
            worker_sizes.append(int(size["world_size"]))
        except (KeyError, TypeError, ValueError):
            return json_error(502, f"{worker.url}/get_world_size answered without a world_size: {size!r}")
    offsets = offsets_after(first, worker_sizes)
    payloads = [
        msgspec.json.encode({**body, "init_info": {**info, "rank_offset": offset}}) for offset in offsets
    ]
    offset = first + sum(worker_sizes)  # the first rank after these workers'
    if offset > world_size:
        return json_error(
            400,
            f"init_info.world_size {world_size} cannot hold ranks {first}..{offset - 1} of the "
            f"{offset - first} worker rank(s) behind this router (plus the trainer's); rebuild it from the "
            "router's /get_world_size",
            param="init_info",
        )
    return payloads


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def handle_control(
    router: InferenceRouter, request: web.Request, headers: dict[str, str]
) -> web.Response:
    """Fan one control-plane call out to every healthy worker, with ``headers`` (the caller's, less the
    hop-by-hop ones), and combine the answers (see the module docstring)."""
    raw = await request.read()
    workers = [worker for worker in router.workers.values() if worker.healthy]
    skipped = {worker.url: _why_out(worker) for worker in router.workers.values() if not worker.healthy}
    if not workers:
        return json_error(503, f"no healthy inference server (of {len(router.workers)}): {skipped}")
    bodies: list[bytes] | web.Response = [raw] * len(workers)
    if request.path == INIT_PATH:
        bodies = await _init_bodies(router, workers, headers, raw)
    if isinstance(bodies, web.Response):
        return bodies
    answers = await _fan_out(router, workers, _Call(request.method, request.path_qs, headers), bodies)
    if isinstance(answers, web.Response):
        return answers
    dicts = [answer if isinstance(answer, dict) else {} for answer in answers]
    combine = COMBINERS.get(request.path, lambda bodies: dict(bodies[0]))
    try:
        combined = combine(dicts)
    except (KeyError, TypeError, ValueError) as error:
        return json_error(502, f"{request.path}: a worker's answer lacks a field: {error!r}")
    by_worker = {worker.url: answer for worker, answer in zip(workers, answers, strict=True)}
    if not skipped:
        return web.json_response({**combined, "workers": by_worker})
    _log.warning("control call skipped unhealthy workers", path=request.path, skipped=skipped)
    return web.json_response({**combined, "workers": by_worker, "skipped": skipped})


def _why_out(worker: RouterWorker) -> str:
    """Why an unhealthy worker is out of the fan-out, as ``/list_workers`` would say it."""
    if worker.engine_dead:
        return "its engine died"
    if worker.stale is not None:
        return f"stale: it serves weight version {worker.stale}"
    return "unhealthy: its health probes fail"
