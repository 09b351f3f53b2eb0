"""Colocation (``inference.colocate``): the inference servers and the trainer take turns on the same devices.

Around each training step, following vLLM's RL recipe (HTTP API, ``shared/reference/vllm-http-api.md``):

1. ``POST /sleep?level=L&mode=M`` on every server: running requests are handled by ``M`` (``wait`` in
   ``sync``, where nothing runs; the barrier's mode in ``one_step``, ``abort`` in place of ``keep``, since the
   KV cache that frozen requests need is freed), then the KV cache is freed (level 1) and the weights too
   (level 2). On a GPU the memory goes back to the driver, where the trainer's process takes it.
2. the training step;
3. ``POST /wake_up?tags=weights``: the weights come back (level 1: as they were; level 2: allocated for the
   push), while the KV cache still sleeps, so the push has room;
4. the weight push (the ``WeightBarrier``: CUDA IPC on GPUs, the configured strategy on CPUs);
5. ``POST /wake_up?tags=kv_cache``: the KV cache is back and scheduling resumes.

Without Ray, on one machine, "sharing the devices" means the servers and trainer rank 0 both see the first
GPU(s) (``rollflow.inference.gpus``); on CPUs they share the cores and memory, and sleeping frees the servers'
KV caches (and weights at level 2) while the trainer steps.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import structlog

from rollflow.config import RunConfig
from rollflow.errors import ConfigError
from rollflow.inference.client import InferenceClient, PauseMode
from rollflow.inference.control import ControlPlane, InProcessControlPlane

log = structlog.get_logger(__name__)


class Colocation:
    """Puts the servers to sleep for a training step and wakes them in two stages around the weight push.

    Args:
        control: the servers' control plane (a ``RemoteInferenceClient``'s ``control``).
        level: the sleep level (``inference.sleep_level``, 1 or 2).
        mode: how sleep treats running requests (abort or wait).
    """

    def __init__(self, control: ControlPlane, *, level: int, mode: PauseMode):
        if level not in (1, 2):
            raise ValueError(f"colocated sleep level must be 1 or 2, got {level!r}")
        if mode not in ("abort", "wait"):
            raise ValueError(f"colocated sleep mode must be 'abort' or 'wait', got {mode!r}")
        self.control = control
        self.level = level
        self.mode: PauseMode = mode
        self.asleep = False

    @classmethod
    def from_config(
        cls, config: RunConfig, client: InferenceClient, pause_mode: PauseMode
    ) -> Colocation | None:
        """The colocation of a run with ``inference.colocate``; None without it.

        Raises:
            ConfigError: the inference client cannot sleep (an in-process client given to the orchestrator).
        """
        if not config.inference.colocate:
            return None
        if isinstance(client.control, InProcessControlPlane):
            raise ConfigError(
                f"inference.colocate = true needs servers that sleep and wake up (an HTTP client); the "
                f"inference client given is a {type(client).__name__}: set inference.colocate = false"
            )
        mode: PauseMode = "abort" if pause_mode == "keep" else pause_mode
        return cls(client.control, level=config.inference.sleep_level, mode=mode)

    async def sleep(self) -> float:
        """Put every server to sleep; returns the seconds it took."""
        started = time.perf_counter()
        await self.control.sleep(level=self.level, mode=self.mode)
        self.asleep = True
        return time.perf_counter() - started

    async def wake(self, push: Callable[[], Awaitable[dict[str, float]]] | None) -> dict[str, float]:
        """Wake the weights, run ``push`` (the weight update; None: no new weights, only at level 1), wake the
        KV cache. Returns ``push``'s timings with ``wake_time_s`` (the two wake-ups together).

        Raises:
            ValueError: ``push`` is None at level 2, where the woken weights must be reloaded.
            Exception: what the wake-ups or ``push`` raised.
        """
        if push is None and self.level == 2:
            raise ValueError(
                "sleep level 2 discards the weights: a push must follow wake_up(tags=['weights'])"
            )
        started = time.perf_counter()
        await self.control.wake_up(["weights"])
        woke_weights = time.perf_counter()
        timings = await push() if push is not None else {}
        pushed = time.perf_counter()
        await self.control.wake_up(["kv_cache"])
        self.asleep = False
        return {**timings, "wake_time_s": (woke_weights - started) + (time.perf_counter() - pushed)}

    async def recover(self, push: Callable[[], Awaitable[dict[str, float]]]) -> None:
        """After a failed training step: wake the servers again (with ``push`` of the weights they should
        serve), so a later ``run`` finds them awake. Best effort: a failure is logged, not raised."""
        if not self.asleep:
            return
        with anyio.CancelScope(shield=True):
            try:
                await self.wake(push)
            except Exception as error:
                log.warning("waking the colocated servers after a failed step failed", error=str(error))
