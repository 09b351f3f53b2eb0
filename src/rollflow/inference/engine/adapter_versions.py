"""Adapter versions in flight: the torch engine keeps the last ``adapter_versions`` LoRA versions unmerged, and
a sequence decodes to its end on the version it started on.

With ``TorchEngine(adapter_versions=N)`` (``rollflow serve --adapter-versions N``) an adapter push does not
touch the weights: it goes into a slot of an ``AdapterStack`` (slot 0 is the base, no adapter), and sequences
admitted from then on run on it. A sequence records its slot and that slot's policy version at its first
admission; every token it samples carries that version, through a preemption too. A push takes the slot of
the oldest version no sequence holds; when every slot is held the push fails (``EngineError``), the engine
unchanged: in the async modes ``max_staleness + 1`` slots are enough, because admission control keeps every
sample within ``max_staleness`` versions.

Full weights still load into the base (every version sees them), as with the merged path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollflow.errors import EngineError
from rollflow.inference.engine.adapter_stack import AdapterStack
from rollflow.inference.engine.adapters import adapter_checksums


class AdapterVersions:
    """The slots of one engine's unmerged adapter versions and which policy version each holds."""

    def __init__(self, model: torch.nn.Module, versions: int):
        if versions < 1:
            raise ValueError(f"adapter_versions must be >= 1 (0 merges adapters instead), got {versions}")
        self.stack = AdapterStack(model, versions + 1)
        #: slot -> the policy version of the adapter it holds (slot 0, the base, is never in it).
        self.slot_versions: dict[int, int] = {}
        #: The slot new sequences run on (0 until the first adapter push).
        self.current = 0
        #: Adapter tensor name -> tensor of each slot, as received (what ``checksums`` hashes).
        self._received: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, adapter: list[tuple[str, torch.Tensor]], policy_version: int, held: Iterable[int]) -> int:
        """Write ``adapter`` as ``policy_version`` into the oldest slot no running or waiting sequence holds
        (``held``: their slots) and make it current; returns the slot.

        Raises:
            EngineError: every slot is held by sequences (naming the versions and how to keep more), or the
                adapter does not fit the model (``AdapterStack.put``).
        """
        held = set(held) | {self.current}
        free = [slot for slot in range(1, self.stack.capacity) if slot not in held]
        if not free:
            raise EngineError(
                f"all {self.stack.capacity - 1} adapter versions are still decoding (policy versions "
                f"{sorted(self.slot_versions.values())}): the engine keeps at most that many; start it with "
                "more (--adapter-versions, at least orchestrator.max_staleness + 1)"
            )
        slot = min(free, key=lambda s: self.slot_versions.get(s, -1))
        tensors = dict(adapter)
        self.stack.put(slot, tensors)
        self.slot_versions[slot] = policy_version
        self._received[slot] = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        self.current = slot
        return slot

    def rows(self, slots: list[int]) -> torch.Tensor | int:
        """The runner's ``adapter_rows`` for rows on these adapter slots: one int when they all agree."""
        first = slots[0]
        if all(slot == first for slot in slots):
            return first
        return torch.tensor(slots, dtype=torch.long, device=self.stack.device)

    def versions(self) -> dict[int, int]:
        """Policy version held by each adapter slot."""
        return dict(self.slot_versions)

    def checksums(self) -> dict[str, str]:
        """SHA-256 of each tensor of the current adapter, as received (``/weight_checker``)."""
        return adapter_checksums(self._received.get(self.current, {}))
