"""rollflow: async-first reinforcement-learning post-training for language models and LLM agents.

The public names are imported lazily, so ``import rollflow`` stays light (no torch, no transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Orchestrator", "RunConfig", "load_config"]

if TYPE_CHECKING:
    from rollflow.config import RunConfig, load_config
    from rollflow.orchestrator import Orchestrator

_LAZY = {
    "Orchestrator": "rollflow.orchestrator",
    "RunConfig": "rollflow.config",
    "load_config": "rollflow.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollflow' has no attribute {name!r}")
