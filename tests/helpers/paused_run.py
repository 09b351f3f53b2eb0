"""``python tests/helpers/paused_run.py run ...``: the real ``rollflow`` command line with one phase of the
run held for a few seconds, so that a test can signal the run inside that phase rather than hope to hit it.

``ROLLFLOW_TEST_PAUSE`` names the phase: ``setup`` (the first weight update, once the engines, any servers,
router and trainer process are up), ``step:N`` (inside training step N, in the process that trains) or
``checkpoint:N`` (inside the checkpoint of step N, after the trainer wrote its files and before the
checkpoint is complete). When the phase begins, ``ROLLFLOW_TEST_PAUSE_MARKER`` is created (it holds the pid
of the process that paused); the pause lasts ``ROLLFLOW_TEST_PAUSE_S`` seconds, or until a file named like
the marker plus ``.release`` appears (as it does once the run has handled a SIGTERM), then the phase goes on
as usual.

The patches sit at module level: with ``trainer.placement = "process"`` the trainer process re-imports this
script (as ``__mp_main__``), so the trainer-side pauses apply there too.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

PHASE, _, PHASE_STEP = os.environ.get("ROLLFLOW_TEST_PAUSE", "").partition(":")
MARKER = Path(os.environ.get("ROLLFLOW_TEST_PAUSE_MARKER", "pause.marker"))
SECONDS = float(os.environ.get("ROLLFLOW_TEST_PAUSE_S", "3"))


RELEASE = MARKER.with_name(MARKER.name + ".release")


def _begin(where: str) -> None:
    MARKER.write_text(f"{where} {os.getpid()}\n")


def _held() -> bool:
    """Whether the pause goes on: polled every 50 ms."""
    return not RELEASE.exists()


def _pause() -> None:
    deadline = time.monotonic() + SECONDS
    while _held() and time.monotonic() < deadline:
        time.sleep(0.05)


if PHASE == "setup":
    from rollflow.orchestrator.barrier import WeightBarrier

    _update = WeightBarrier.update

    async def _paused_update(self, weights, policy_version, *args, **kwargs):
        if not MARKER.exists():
            _begin("setup")
            deadline = time.monotonic() + SECONDS
            while _held() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return await _update(self, weights, policy_version, *args, **kwargs)

    WeightBarrier.update = _paused_update

if PHASE == "step":
    from rollflow.train.trainer import Trainer

    _train_step = Trainer.train_step

    def _paused_train_step(self, batch, *args, **kwargs):
        if batch.step == int(PHASE_STEP):
            _begin(f"step {batch.step}")
            _pause()
        return _train_step(self, batch, *args, **kwargs)

    Trainer.train_step = _paused_train_step

if PHASE == "checkpoint":
    from rollflow.train.trainer import Trainer

    _save_checkpoint = Trainer.save_checkpoint

    def _paused_save_checkpoint(self, directory):
        _save_checkpoint(self, directory)
        if Path(directory).name == f"step_{int(PHASE_STEP):06d}.tmp":
            _begin(f"checkpoint {directory}")
            _pause()

    Trainer.save_checkpoint = _paused_save_checkpoint


def _release_on_sigterm() -> None:
    """Once the run has taken SIGTERM in, the pause has done its work: a phase held in a thread or a trainer
    process goes on at once instead of at the end of ``ROLLFLOW_TEST_PAUSE_S``. The run's handler runs first,
    on the main thread, so the stop is under way before the phase can finish."""
    from rollflow.cli import _Termination

    handle = _Termination._handle.__func__

    def release_after(cls, signum, frame):
        try:
            handle(cls, signum, frame)
        finally:
            if MARKER.exists():
                RELEASE.touch()

    _Termination._handle = classmethod(release_after)


if __name__ == "__main__":
    from rollflow.cli import main

    _release_on_sigterm()

    sys.exit(main(sys.argv[1:]))
