"""The trainer handle: what the orchestrator calls on a trainer, wherever its ranks run.

Four implementations: ``Trainer`` (in this process), ``TrainerProcess`` (one child process), and two
``RankGroup``s of ``trainer.num_workers`` data-parallel ranks in one torch.distributed group:
``TrainerWorkers`` (local processes) and ``rollflow.launch.ray_trainer.RayTrainerWorkers`` (Ray actors).
Every method blocks; the orchestrator calls them from a worker thread, one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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

    def probe_logprobs(self, token_ids: Sequence[int], start: int = 1) -> list[float]:
        """The current weights' logprob of each of ``token_ids[start:]`` after the ones before it
        (``Trainer.probe_logprobs``): what a server holding these weights must compute."""
        ...

    def save_checkpoint(self, directory: str | Path) -> None: ...

    def load_checkpoint(self, directory: str | Path) -> None: ...

    def close(self) -> None:
        """Release the ranks (processes, process group); idempotent."""
        ...


class RankGroup:
    """The trainer handle over ``world_size`` ranks that each run a ``Trainer``: every call goes to every
    rank through ``_call`` and rank 0 answers. Subclasses own the ranks (local worker processes, Ray actors)
    and their transport."""

    world_size: int

    def _call(
        self, method: str, args: tuple[Any, ...] = (), per_rank: list[tuple[Any, ...]] | None = None
    ) -> list[Any]:
        """Run ``method`` on every rank (``per_rank[r]`` as rank r's arguments, else ``args``); the answers in
        rank order."""
        raise NotImplementedError

    def train_step(self, batch: PackedBatch, policy_version: int | None = None) -> StepResult:
        """One optimizer step: rank ``r`` trains ``batch.ranks[r]``; the step's result (rank 0's, with the
        packer's metrics)."""
        if len(batch.ranks) != self.world_size:
            raise ValueError(
                f"step {batch.step} was packed for {len(batch.ranks)} ranks, but the trainer has "
                f"{self.world_size} (trainer.num_workers); pack it with num_ranks = trainer.world_size"
            )
        results = self._call("train_step", per_rank=[(share, policy_version) for share in batch.ranks])
        result: StepResult = results[0]
        result.metrics = {**batch.metrics, **result.metrics}
        return result

    def named_weights(self) -> NamedWeights:
        """The full weights (every rank joins each shard's gather; rank 0 sends them here), CPU copies in
        ``Trainer.named_weights``'s names and order."""
        yield from self._call("full_weights")[0]

    def push_weights(self, push: WeightPush) -> Any:
        """Run ``push(rank, named_weights)`` (picklable) on every rank, on its rank's weights (DTensor shards
        under ``fsdp2``); rank 0's result (its sender listens on rank 0's node)."""
        return self._call("push_weights", (push,))[0]

    def probe_logprobs(self, token_ids: Sequence[int], start: int = 1) -> list[float]:
        """``Trainer.probe_logprobs`` on every rank (a sharded forward needs them all); rank 0's answer."""
        return self._call("probe_logprobs", (list(token_ids), start))[0]

    def save_checkpoint(self, directory: str | Path) -> None:
        """Every rank writes its shards (``rollflow.train.sharded``); rank 0 also the full weights."""
        self._call("save_checkpoint", (str(Path(directory).resolve()),))

    def load_checkpoint(self, directory: str | Path) -> None:
        """Every rank reads its shards, resharded from whatever number of ranks wrote them."""
        self._call("load_checkpoint", (str(Path(directory).resolve()),))
