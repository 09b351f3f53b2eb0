"""The router's health checks: which servers are in rotation (see ``rollflow.inference.router``'s docstring,
"Failure handling"). A probe asks each server for one token every ``health_check_interval_s``; a server is
taken out when it refuses connections, says its engine died, or hangs (``HUNG_PROBES`` timed-out probes in a
row while neither paused nor making progress), and comes back once a probe succeeds, unless it serves a stale
policy version."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import structlog

from rollflow.http.upstream import UpstreamPool
from rollflow.inference.router_workers import RouterWorker, is_engine_dead

log = structlog.get_logger("rollflow.inference.router")

_HEALTH_PROBE = msgspec.json.encode(
    {
        "token_ids": [0],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        "request_id": "router-health",
    }
)
# Timed-out probes in a row, with the server neither paused nor making progress, that take it out as hung:
# one could be a burst that filled the engine's batch; two, a health_check_timeout_s apart, are a stall.
HUNG_PROBES = 2


class RouterHealth:
    """The health half of ``InferenceRouter``: marking servers dead or alive, and the probe loop. The router
    provides the state below and the ring it rebuilds (``_rebuild_ring``, ``_forget_sessions_of``)."""

    workers: dict[str, RouterWorker]
    health_check_interval_s: float
    health_check_timeout_s: float
    connect_timeout_s: float
    num_dead_engines: int
    _client: aiohttp.ClientSession | None
    _pools: dict[str, UpstreamPool]

    def _rebuild_ring(self) -> None:
        raise NotImplementedError

    def _forget_sessions_of(self, url: str) -> None:
        raise NotImplementedError

    def _mark_dead(self, worker: RouterWorker, reason: str, *, engine_dead: bool = False) -> None:
        if engine_dead and not worker.engine_dead:
            worker.engine_dead = True
            self.num_dead_engines += 1
        if worker.healthy:
            worker.healthy = False
            self._forget_sessions_of(worker.url)
            self._rebuild_ring()
            pool = self._pools.get(worker.url)
            given_up = pool.abort(f"{worker.url} was taken out: {reason}") if pool is not None else 0
            log.warning("worker taken out", worker=worker.url, reason=reason, requests_given_up=given_up)

    async def _answered_probe(self, worker: RouterWorker) -> None:
        """``worker`` answered a probe: back into rotation, unless it serves a stale policy version."""
        if worker.healthy or worker.url not in self.workers:
            return
        stale = await self._stale_version(worker)
        if stale is not None:
            if worker.stale != stale:
                log.warning("worker kept out", worker=worker.url, reason=stale)
            worker.stale = stale
            return
        self._mark_alive(worker)

    def _mark_alive(self, worker: RouterWorker) -> None:
        if not worker.healthy and worker.url in self.workers:
            worker.healthy = True
            worker.engine_dead = False
            worker.stale = None
            self._rebuild_ring()
            log.info("worker back in", worker=worker.url)

    async def _stale_version(self, worker: RouterWorker) -> str | None:
        """Why ``worker`` must stay out though it answers: it serves another policy version than the servers
        in rotation (it was down while they took a weight update). None when it may rejoin: the same version,
        no server in rotation to compare with, or a server that cannot say (no ``/weight_info``)."""
        in_rotation = [w for w in self.workers.values() if w.healthy]
        if not in_rotation:
            return None
        versions = await asyncio.gather(*(self._weight_version(w) for w in [worker, *in_rotation]))
        own, others = versions[0], {v for v in versions[1:] if v is not None}
        if own is None or not others or own in others:
            return None
        return (
            f"it serves policy version {own} and the servers in rotation {', '.join(sorted(others))}: it was "
            "down during a weight update; push weights to it again (restart it, or restart the run's "
            "weight sync) to bring it back"
        )

    async def _weight_version(self, worker: RouterWorker) -> str | None:
        """``/weight_info``'s ``weight_version`` of ``worker``, None when it cannot tell."""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/weight_info", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                if response.status != 200:
                    return None
                version = (await response.json()).get("weight_version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        return None if version is None else str(version)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            await asyncio.gather(*(self._probe(worker) for worker in list(self.workers.values())))

    async def _probe(self, worker: RouterWorker) -> None:
        """Ask ``worker`` for one token; mark it dead or alive from the answer."""
        assert self._client is not None
        started = asyncio.get_running_loop().time()
        try:
            async with self._client.post(
                f"{worker.url}/inference/v1/generate",
                data=_HEALTH_PROBE,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(
                    total=self.health_check_timeout_s, sock_connect=self.connect_timeout_s
                ),
            ) as response:
                body = await response.read()
                if is_engine_dead(response.status, body):
                    self._mark_dead(worker, "its engine died (health probe)", engine_dead=True)
                    return
                # 503: paused in abort/wait mode, alive. Other 4xx: alive but rejecting the probe (logged).
                alive = response.status < 500 or response.status == 503
                if 400 <= response.status < 500:
                    log.debug("health probe rejected", worker=worker.url, status=response.status)
        except aiohttp.ClientConnectorError as error:
            self._mark_dead(worker, f"health probe could not connect: {error}")
            return
        except TimeoutError:
            reason = await self._why_hung(worker, since=started)
            if reason is None:
                await self._answered_probe(worker)
            else:
                self._mark_dead(worker, reason)
            return
        except aiohttp.ClientError:
            alive = await self._answers_health(worker)
        if alive:
            worker.hung_probes = 0
            await self._answered_probe(worker)
        else:
            self._mark_dead(worker, "health probe failed")

    async def _why_hung(self, worker: RouterWorker, *, since: float) -> str | None:
        """After a probe that got no token within ``health_check_timeout_s``: why ``worker`` counts as hung,
        or None while it is not (yet). Paused (``keep`` mode queues the probe) and busy (an answer through the
        router began, streamed or ended since the probe was sent) are alive; a server that answers neither
        ``/is_paused`` nor ``/health`` is dead; one that answers but makes no progress is hung at the
        ``HUNG_PROBES``-th such probe in a row."""
        if worker.last_progress >= since:
            worker.hung_probes = 0
            return None
        paused = await self._is_paused(worker)
        if paused:
            worker.hung_probes = 0
            return None
        if paused is None and not await self._answers_health(worker):
            return "health probe failed"
        worker.hung_probes += 1
        if worker.hung_probes < HUNG_PROBES:
            return None
        return (
            f"its generation is hung: {worker.hung_probes} probes in a row got no token within "
            f"health_check_timeout_s = {self.health_check_timeout_s:g} s, and it is not paused and finished "
            "nothing meanwhile"
        )

    async def _is_paused(self, worker: RouterWorker) -> bool | None:
        """``/is_paused`` of ``worker``: False when it has no such endpoint (it cannot be paused), None when it
        did not answer."""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/is_paused", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                if response.status == 404:
                    return False
                if response.status != 200:
                    return None
                return bool((await response.json()).get("is_paused"))
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    async def _answers_health(self, worker: RouterWorker) -> bool:
        """A slow probe may just be a busy or keep-paused server: does ``GET /health`` still answer 200?"""
        assert self._client is not None
        try:
            async with self._client.get(
                f"{worker.url}/health", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
