"""rollflow's torch inference engine: continuous batching with a KV cache, in process.

``TorchEngine`` is imported lazily so that importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TorchEngine"]

if TYPE_CHECKING:
    from rollflow.inference.engine.engine import TorchEngine


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from rollflow.inference.engine.engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module 'rollflow.inference.engine' has no attribute {name!r}")
