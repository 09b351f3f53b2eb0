"""``local``: engines in the trainer's process; weights are handed over as tensors, nothing is serialized.

It exists so the weight barrier has one code path for every strategy: ``push`` calls
``LocalInferenceClient.update_named_weights`` (each engine copies the tensors into its own model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollflow.weights.base import WeightSender, WeightTransferStrategy


class LocalStrategy(WeightTransferStrategy):
    """In-process engines (``inference.mode = "local"``)."""

    name = "local"

    def create_init_info(self, inference_world_size: int) -> dict[str, Any]:
        return {"backend": "local"}

    def create_sender(self, init_info: dict[str, Any]) -> LocalSender:
        return LocalSender(init_info)


class LocalSender(WeightSender):
    """Calls ``client.update_named_weights(named_weights, policy_version)`` of an in-process client."""

    async def setup(self, client: Any) -> None:
        """Nothing to connect."""

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        await client.update_named_weights(named_weights, policy_version)
