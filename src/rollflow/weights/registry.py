"""The weight-strategy registry: a strategy is one module and one line here.

Each entry maps a ``weight_sync.strategy`` name to the ``module:Class`` of its ``WeightTransferStrategy``;
the class is imported on first use (the control halves import no torch, so this stays cheap). The class owns
how its keyword options come from the ``weight_sync`` config section (``WeightTransferStrategy.options_from``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.weights.base import WeightTransferStrategy

#: ``weight_sync.strategy`` name -> ``"module:Class"`` of its strategy.
_REGISTRY: dict[str, str] = {
    "local": "rollflow.weights.local:LocalStrategy",
    "broadcast": "rollflow.weights.broadcast:BroadcastStrategy",
    "checkpoint": "rollflow.weights.checkpoint:CheckpointStrategy",
    "cuda_ipc": "rollflow.weights.cuda_ipc:CudaIpcStrategy",
    # A [trainer.lora] run's adapter into vLLM servers (chosen by the barrier, not by weight_sync.strategy).
    "vllm_lora": "rollflow.weights.vllm_lora:VllmLoraStrategy",
}


def register_strategy(name: str, target: str) -> None:
    """Make ``name`` buildable by ``create_strategy``: ``target`` is ``"module:Class"`` of a
    ``WeightTransferStrategy`` subclass, imported on first use.

    Raises:
        ValueError: ``name`` is registered already, or ``target`` is not ``module:Class``.
    """
    if name in _REGISTRY:
        raise ValueError(f"weight transfer strategy {name!r} is registered already ({_REGISTRY[name]})")
    if target.count(":") != 1:
        raise ValueError(f"a strategy target is 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name, in registration order."""
    return tuple(_REGISTRY)


def strategy_class(name: str) -> type[WeightTransferStrategy]:
    """The strategy class registered as ``name``.

    Raises:
        ValueError: an unknown strategy name (the message lists the known ones).
    """
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(
            f"unknown weight transfer strategy {name!r}; choose one of {', '.join(strategy_names())}"
        )
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


def create_strategy(name: str, **options: object) -> WeightTransferStrategy:
    """Build the strategy registered as ``name`` with its keyword options.

    Raises:
        ValueError: an unknown strategy name, or a bad option value.
        TypeError: an option the strategy does not take.
    """
    return strategy_class(name)(**options)


def strategy_options(
    name: str, sync: WeightSyncConfig, *, engine: str = "torch", master_address: str = "127.0.0.1"
) -> dict[str, object]:
    """The keyword options of strategy ``name`` read from the ``weight_sync`` section ``sync``, for servers of
    kind ``engine`` (``inference.engine``), with ``master_address`` already resolved from ``"auto"``.

    Raises:
        ValueError: an unknown strategy name.
    """
    return strategy_class(name).options_from(sync, engine=engine, master_address=master_address)


def strategy_from_config(
    name: str, sync: WeightSyncConfig, *, engine: str = "torch", master_address: str = "127.0.0.1"
) -> WeightTransferStrategy:
    """The strategy ``name`` configured from the ``weight_sync`` section ``sync``.

    Raises:
        ValueError: an unknown strategy name, or a bad option value.
    """
    options = strategy_options(name, sync, engine=engine, master_address=master_address)
    return strategy_class(name)(**options)
