"""Schedules decide when a prompt may start generating and how weight updates treat in-flight work.

The data source asks ``admit()`` before every prompt; the training loop calls ``open_step()`` when it wants
the prompts of the next step. A new schedule (one-step-off, fully async with a staleness bound) changes
only these decisions; the pipeline itself stays as it is.
"""

from __future__ import annotations

from typing import Protocol

import anyio

from rollflow.inference.client import PauseMode


class Schedule(Protocol):
    pause_mode: PauseMode
    """How the weight-update barrier pauses the engines."""

    async def admit(self) -> None:
        """Wait until one more prompt may start generating."""
        ...

    def open_step(self, step: int) -> None:
        """The training loop is about to collect the batch of ``step``."""
        ...


class SyncSchedule:
    """Generate exactly one step's prompts, train on them, update weights, repeat.

    Nothing is in flight at a barrier, so every sample of step t was produced by policy version t − 1 and
    the barrier's pause never has anything to wait for.
    """

    pause_mode: PauseMode = "wait"

    def __init__(self, prompts_per_step: int):
        self.prompts_per_step = prompts_per_step
        self._credits = 0
        self._changed = anyio.Event()

    async def admit(self) -> None:
        while self._credits == 0:
            await self._changed.wait()
        self._credits -= 1

    def open_step(self, step: int) -> None:
        self._credits += self.prompts_per_step
        self._changed.set()
        self._changed = anyio.Event()
