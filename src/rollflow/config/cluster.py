"""``[cluster]``: where the run's processes run (this machine or a Ray cluster)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

import msgspec

from rollflow.config.base import Positive, PositiveFloat, Section

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class ClusterConfig(Section):
    """Where the run's processes run (``rollflow.launch``): on this machine, or placed on a Ray cluster."""

    backend: Literal["local", "ray"] = "local"
    """``local``: engine servers, router and trainer workers are subprocesses of this one. ``ray``: engine
    servers and trainer workers run as Ray actors placed by a placement plan (``rollflow run --dry-run``
    prints it); the orchestrator, the router and the client stay here and reach the servers by URL. Needs
    ``pip install 'rollflow[ray]'``."""
    address: str = "local"
    """The Ray cluster: ``local`` starts a private Ray instance on this machine for the run; ``auto`` joins
    the cluster this machine belongs to (``ray start --head`` / ``ray start --address``); ``HOST:PORT`` or
    ``ray://HOST:PORT`` joins the one there."""
    placement_timeout_s: PositiveFloat = 180.0
    """Longest the run waits for the cluster to grant its placement groups (a multi-node start takes about a
    minute); then it fails with what was asked, what the cluster has and the keys to change."""
    env: dict[str, str] = {}
    """Environment variables set in every actor (trainer workers, server launchers, and so the servers)."""
    forward_env: list[str] = msgspec.field(default_factory=lambda: ["NCCL_*", "GLOO_*", "HF_*"])
    """Variables of this process's environment forwarded into every actor, as names or ``fnmatch`` patterns
    (the network interfaces NCCL and gloo bind, the Hugging Face cache); ``env`` wins over them."""
    cpus_per_worker: PositiveFloat = 1.0
    """Ray CPUs reserved for each trainer worker (its bundle: these CPUs, and one GPU when it trains on GPUs)."""
    cpus_per_server: PositiveFloat = 1.0
    """Ray CPUs reserved for each engine server (its bundle: these CPUs and its tensor-parallel GPUs)."""
    num_cpus: Positive | None = None
    """``address = "local"``: CPUs of the private Ray instance (unset: Ray counts this machine's)."""


def cluster_errors(config: RunConfig) -> list[str]:
    cluster = config.cluster
    errors = []
    address = cluster.address
    if address not in ("local", "auto") and not _RAY_ADDRESS.fullmatch(address):
        errors.append(
            f"cluster.address = {address!r} must be 'local' (a private Ray instance), 'auto' (the cluster this "
            "machine joined with `ray start`) or a head address like 'HOST:6379' or 'ray://HOST:10001'"
        )
    for name in cluster.env:
        if not _ENV_NAME.fullmatch(name):
            errors.append(f"cluster.env has {name!r}, which is not an environment variable name")
    if cluster.backend == "local":
        changed = [
            f"cluster.{key}"
            for key in ("address", "env", "num_cpus")
            if getattr(cluster, key) != getattr(_CLUSTER_DEFAULTS, key)
        ]
        if changed:
            errors.append(
                f"{' and '.join(changed)} only apply to cluster.backend = 'ray' (got 'local', which runs "
                "every process on this machine); set cluster.backend = 'ray' or remove them"
            )
    else:
        if cluster.num_cpus is not None and address != "local":
            errors.append(
                f"cluster.num_cpus sizes the private Ray instance of cluster.address = 'local', not the "
                f"cluster at {address!r}; remove it"
            )
        if config.trainer.placement == "process":
            errors.append(
                "trainer.placement = 'process' places a local trainer; with cluster.backend = 'ray' the "
                "trainer's ranks always run as Ray actors (trainer.num_workers of them): remove "
                "trainer.placement or set cluster.backend = 'local'"
            )
    return errors


_RAY_ADDRESS = re.compile(r"(ray://)?[A-Za-z0-9._\-\[\]:]+:[0-9]{1,5}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLUSTER_DEFAULTS = ClusterConfig()
