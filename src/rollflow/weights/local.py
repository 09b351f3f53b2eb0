"""``local``: engines in the trainer's process; weights are handed over as tensors, nothing is serialized.

It exists so the weight barrier has one code path for every strategy: ``push`` reads the trainer's weights in
this process (``WeightSource.named_weights``: an in-thread trainer's tensors, or a trainer process's shared
memory) and calls ``LocalInferenceClient.update_named_weights`` (each engine copies them into its own model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollflow.weights.base import WeightSender, WeightSource, WeightTransferStrategy, as_source


class LocalStrategy(WeightTransferStrategy):
    """In-process engines (``inference.mode = "local"``)."""

    name = "local"

    def create_sender(self, inference_world_size: int) -> LocalSender:
        return LocalSender(inference_world_size)


class LocalSender(WeightSender):
    """Calls ``client.update_named_weights(named_weights, policy_version)`` of an in-process client."""

    async def setup(self, client: Any, source: WeightSource, release: Iterable[str] = ()) -> None:
        """Nothing to connect."""
        self.init_info = {"backend": "local"}

    async def push(self, client: Any, source: WeightSource, policy_version: int) -> None:
        source = as_source(source)
        await client.update_named_weights(source.named_weights(), policy_version)
