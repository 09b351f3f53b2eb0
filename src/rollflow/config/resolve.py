"""``resolve_config``: every ``auto`` the config alone decides, turned into its value before components see it.

Decided here, from the config only (a pure function, no I/O, no torch):

- ``trainer.off_policy``: ``none`` in ``sync`` mode, ``tis`` in the async modes;
- ``weight_sync.strategy``: ``local`` in local mode, ``broadcast`` in http mode; a colocated run keeps
  ``auto`` (see below);
- ``inference.router``: whether rollflow starts a router (``starts_router``; the key has no value for
  "never", so this one is a decision, not a rewritten key).

Left where the facts are, because the config cannot know them:

- ``trainer.device`` / ``inference.device`` (and so ``trainer.dtype``, and a colocated run's
  ``weight_sync.strategy``, which is ``cuda_ipc`` when trainer and servers share CUDA devices): probed
  with torch in the process that has the device (``rollflow.models.loading.resolve_device``), and for a
  placement plan against the cluster's GPUs (``rollflow.launch.plan``);
- ``weight_sync.master_address``: trainer rank 0's node, known once the trainer is placed;
- ``model.renderer``: read from the model's files (the orchestrator records the result in ``config.json``);
- ``inference.dtype`` / ``weight_sync.dtype``: ``auto`` is a value there (the checkpoint's own dtype).

The saved ``config.json`` keeps what the user wrote (a resumed run may change the inference mode); resolve
the config where components are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from rollflow.config.inference import InferenceConfig
    from rollflow.config.run import RunConfig


def off_policy_for(off_policy: str, orchestrator_mode: str) -> Literal["none", "tis", "decoupled"]:
    """``trainer.off_policy`` with ``auto`` resolved for ``orchestrator.mode``."""
    if off_policy != "auto":
        return off_policy  # type: ignore[return-value]
    return "none" if orchestrator_mode == "sync" else "tis"


def strategy_for(strategy: str, inference_mode: str) -> str:
    """``weight_sync.strategy`` with ``auto`` resolved for ``inference.mode`` (a colocated run on CUDA then
    upgrades ``broadcast`` to ``cuda_ipc`` where the devices are known)."""
    if strategy != "auto":
        return strategy
    return "local" if inference_mode == "local" else "broadcast"


def starts_router(inference: InferenceConfig) -> bool:
    """Whether rollflow starts a router in front of the servers: never before an ``external_proxy_url``;
    with ``router = "auto"`` only over two or more servers (its own ``num_servers``, or the
    ``external_server_urls``); always with ``router = "always"``."""
    if inference.mode == "local" or inference.external_proxy_url is not None:
        return False
    servers = len(inference.external_server_urls) or inference.num_servers
    return inference.router == "always" or servers > 1


def resolve_config(config: RunConfig) -> RunConfig:
    """``config`` with each ``auto`` it alone decides replaced by its value (see the module docstring);
    idempotent."""
    trainer = msgspec.structs.replace(
        config.trainer, off_policy=off_policy_for(config.trainer.off_policy, config.orchestrator.mode)
    )
    weight_sync = config.weight_sync
    if not config.inference.colocate:
        weight_sync = msgspec.structs.replace(
            weight_sync, strategy=strategy_for(weight_sync.strategy, config.inference.mode)
        )
    return msgspec.structs.replace(config, trainer=trainer, weight_sync=weight_sync)
