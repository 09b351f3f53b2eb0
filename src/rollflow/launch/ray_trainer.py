"""Trainer workers as Ray actors behind the trainer handle (``RayTrainerWorkers``).

One actor per rank, each in its bundle of the plan's trainer placement group (so on the node the plan chose,
with the GPU Ray assigned it as its only visible device). The ranks build the same ``Trainer`` local worker
processes do (``rollflow.train.workers.build_rank``): rank 0 opens the group's rendezvous store on its node's
address, the others join it there, and the handle's calls fan out to every rank as in ``TrainerWorkers``
(rank ``r`` trains the ``r``-th share of a packed batch; rank 0's answer is the step's).

A rank that dies (its actor, process or node) ends the call in progress with a ``TrainerWorkerError`` naming
the rank and its node; the others are killed with it, since they would wait for it in their next collective.
Every call blocks; the orchestrator runs them in a worker thread, never on the event loop.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import structlog

from rollflow.launch.plan import PlacementPlan
from rollflow.train.handle import RankGroup
from rollflow.train.process import STARTUP_TIMEOUT_S, TrainerSpec
from rollflow.train.workers import ERROR_GRACE_S, TrainerWorkerError

log = structlog.get_logger(__name__)

CLOSE_TIMEOUT_S = 10.0


class TrainerRank:
    """One rank, as a Ray actor (the class is wrapped with ``ray.remote`` where it is started)."""

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int, threads: int):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.threads = threads
        self.store: Any = None
        self.trainer: Any = None

    def info(self) -> dict[str, Any]:
        """Where this rank runs: node id and address, pid, the GPUs Ray assigned it."""
        import ray

        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node_id": context.get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def open_store(self) -> int:
        """Rank 0: host the rendezvous store on this node's address; its port."""
        import ray

        from rollflow.train.workers import open_store

        self.store = open_store(ray.util.get_node_ip_address(), 0, self.world_size, is_master=True)
        return self.store.port

    def join(self, address: str, port: int) -> None:
        """Join the group through rank 0's store and build this rank's trainer."""
        import torch

        from rollflow.train.workers import build_rank, open_store

        if self.store is None:
            self.store = open_store(address, port, self.world_size, is_master=False)
        setting = self.spec.config.device
        cuda = setting == "cuda" or (setting == "auto" and torch.cuda.is_available())
        # Ray made the bundle's GPU this process's only visible one: device 0.
        self.trainer = build_rank(
            self.spec, self.rank, self.world_size, "cuda" if cuda else "cpu", self.threads, self.store, 0
        )

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        from rollflow.train.workers import run_call

        return run_call(self.trainer, method, list(args))

    def close(self) -> None:
        from rollflow.train.workers import leave_group

        leave_group()


class RayTrainerWorkers(RankGroup):
    """``len(plan.workers)`` data-parallel trainer ranks as Ray actors behind one handle (``TrainerHandle``).

    Raises (from the constructor):
        TrainerWorkerError: a rank died or the group was not ready within ``STARTUP_TIMEOUT_S``.
        Exception: what building the trainer raised in a rank (e.g. a model that does not load).
    """

    def __init__(
        self, ray: Any, spec: TrainerSpec, plan: PlacementPlan, placement_group: Any, env: dict[str, str]
    ):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.world_size = len(plan.workers)
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._where = [f"{slot.node.address} [{slot.node.node_id[:8]}]" for slot in plan.workers]
        actor_class = ray.remote(TrainerRank)
        self._actors: list[Any] = []
        for slot in plan.workers:
            threads = spec.config.num_threads or max(1, int(slot.bundle.cpus))
            self._actors.append(
                actor_class.options(
                    num_cpus=slot.bundle.cpus,
                    num_gpus=slot.bundle.gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=slot.rank
                    ),
                    runtime_env={"env_vars": env},
                    max_restarts=0,
                    name=None,
                ).remote(spec, slot.rank, self.world_size, threads)
            )
        try:
            self.ranks: list[dict[str, Any]] = self._gather(
                "start", [a.info.remote() for a in self._actors], STARTUP_TIMEOUT_S
            )
            self._where = [f"{info['address']} [{info['node_id'][:8]}]" for info in self.ranks]
            (port,) = self._gather(
                "start", [self._actors[0].open_store.remote()], STARTUP_TIMEOUT_S, ranks=[0]
            )
            self.master_address: str = self.ranks[0]["address"]
            refs = [actor.join.remote(self.master_address, port) for actor in self._actors]
            self._gather("start", refs, STARTUP_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        log.info("trainer workers ready on Ray", ranks=[f"{r['rank']}@{r['address']}" for r in self.ranks])

    def close(self) -> None:
        """Leave the group and end every rank's actor. Idempotent."""
        with self._lock:
            if self._actors and self._failure is None:
                refs = [actor.close.remote() for actor in self._actors]
                self._ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
            self._kill()

    # ---------------------------------------------------------------- calls

    def _call(
        self, method: str, args: tuple[Any, ...] = (), per_rank: list[tuple[Any, ...]] | None = None
    ) -> list[Any]:
        with self._lock:
            if self._failure is not None:
                raise TrainerWorkerError(f"the trainer workers were stopped: {self._failure}")
            refs = [
                actor.call.remote(method, args if per_rank is None else per_rank[rank])
                for rank, actor in enumerate(self._actors)
            ]
            return self._gather(method, refs)

    def _gather(
        self, method: str, refs: list[Any], timeout: float | None = None, ranks: list[int] | None = None
    ) -> list[Any]:
        """Each rank's answer, in rank order. A dead rank ends the call naming it and its node; an error raised
        in one ends it once the others answered or ``ERROR_GRACE_S`` passed (then they are stuck waiting for
        the failed rank in a collective, and are killed)."""
        ray = self._ray
        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks, strict=True))
        values: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready:
                if errors:
                    break
                self._fail(f"ranks {sorted(pending.values())} did not answer {method} within {timeout:.0f} s")
                raise TrainerWorkerError(
                    f"trainer workers {sorted(pending.values())} did not answer {method} within {timeout:.0f} s"
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    values[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    errors[rank] = cause
                    deadline = time.monotonic() + ERROR_GRACE_S
                except ray.exceptions.RayActorError as error:
                    message = (
                        f"trainer worker rank {rank} on node {self._where[rank]} died during {method} "
                        f"({type(error).__name__}); the other ranks were stopped"
                    )
                    self._fail(message)
                    raise TrainerWorkerError(message) from None
        if errors:
            rank = min(errors)
            error = errors[rank]
            if pending:
                self._fail(f"rank {rank} raised {type(error).__name__} during {method}")
            error.add_note(f"raised in trainer worker rank {rank} on node {self._where[rank]}")
            raise error
        return [values[rank] for rank in sorted(values)]

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._kill()

    def _kill(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception as error:  # already gone; teardown goes on
                log.debug("trainer actor already gone", error=str(error))
        self._actors = []
