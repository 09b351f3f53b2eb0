"""The trainer handle: what the orchestrator calls on a trainer, wherever its ranks run.

Three implementations: ``Trainer`` (in this process), ``TrainerProcess`` (one child process) and
``TrainerWorkers`` (``trainer.num_workers`` data-parallel processes in one torch.distributed group). Every
method blocks; the orchestrator calls them from a worker thread, one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollflow.messages import PackedBatch, StepResult

NamedWeights = Iterator[tuple[str, Any]]
WeightPush = Callable[[int, NamedWeights], Any]
"""``push(rank, named_weights)`` (e.g. a ``rollflow.weights.TransportCall``), run on every rank with that rank's named weights (DTensor shards under
FSDP2: every rank iterates them, so that every ``full_tensor()`` gather has all ranks; rank 0 sends)."""


@runtime_checkable
class TrainerHandle(Protocol):
    @property
    def world_size(self) -> int:
        """Data-parallel ranks: the packer splits each step into this many shares."""
        ...

    def train_step(self, batch: PackedBatch, policy_version: int | None = None) -> StepResult:
        """One optimizer step on a batch packed for ``world_size`` ranks."""
        ...

    def named_weights(self) -> NamedWeights:
        """Full (unsharded) ``(name, tensor)`` pairs of the current weights, Hugging Face names, for the
        weight barrier; read them before the next ``train_step``."""
        ...

    def push_weights(self, push: WeightPush) -> Any:
        """Run ``push`` on every rank (see ``WeightPush``); rank 0's result (the one that sent). Over a
        process boundary ``push`` must pickle (a module-level function or a ``functools.partial`` of one)."""
        ...

    def save_checkpoint(self, directory: str | Path) -> None: ...

    def load_checkpoint(self, directory: str | Path) -> None: ...

    def close(self) -> None:
        """Release the ranks (processes, process group); idempotent."""
        ...
