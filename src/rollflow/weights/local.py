"""``local``: engines in the trainer's process; weights are handed over as tensors, nothing is serialized.

It exists so the weight barrier has one code path for every strategy: ``push`` reads the trainer's weights in
this process (``WeightSource.named_weights``: an in-thread trainer's tensors, or a trainer process's shared
memory) and hands them to the in-process control plane's ``load_weights`` (each engine copies them into its own
model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rollflow.errors import WeightTransferError
from rollflow.weights.base import (
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
)

if TYPE_CHECKING:
    from rollflow.inference.control import ControlPlane


def _in_process(control: ControlPlane) -> bool:
    # Imported at call time: the engine server (rollflow.inference) imports this package's receiver, so a
    # module-level import back into rollflow.inference would make the two packages import each other.
    from rollflow.inference.control import InProcessControlPlane

    return isinstance(control, InProcessControlPlane)


class LocalStrategy(WeightTransferStrategy):
    """In-process engines (``inference.mode = "local"``)."""

    name = "local"

    def create_sender(self, inference_world_size: int) -> LocalSender:
        return LocalSender(inference_world_size)


class LocalSender(WeightSender):
    """Calls ``control.load_weights(named_weights, policy_version)`` of an in-process control plane."""

    label = "local"
    how = "in process"

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        """Nothing to connect, but the engines must be in this process."""
        if not _in_process(control):
            raise WeightTransferError(
                f"weight_sync.strategy = 'local' needs in-process engines, but the control plane is a "
                f"{type(control).__name__}: use 'broadcast' or 'checkpoint' for servers"
            )
        self.init_info = {"backend": "local"}

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        assert _in_process(control)  # checked by _connect
        await control.load_weights(source.named_weights(), policy_version)  # type: ignore[attr-defined]
