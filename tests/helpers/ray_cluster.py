"""One private Ray cluster for the Ray tests (session-scoped): a head and two worker "nodes" on this machine.

``ray.cluster_utils.Cluster`` starts a raylet per node; each node declares 2 GPUs that do not exist (Ray only
counts them: it hands them out and sets ``CUDA_VISIBLE_DEVICES``, while torch, seeing no CUDA, trains and
serves on the CPU), so the plan places trainer workers and servers exactly as on a GPU cluster. Ray's own CPU
use stays low: no dashboard, few CPUs, no prestarted workers. The test process itself is the driver.
"""

from __future__ import annotations

import os

import pytest

NODE_CPUS = 2
NODE_GPUS = 2


@pytest.fixture(scope="session")
def ray_cluster():
    """``(ray, cluster)``: this process connected to a head (1 CPU, no GPU) and two nodes (2 CPUs, 2 GPUs)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    system = {"num_workers_soft_limit": 4, "enable_worker_prestart": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "_system_config": system},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=NODE_CPUS, num_gpus=NODE_GPUS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False)
    yield ray, cluster
    ray.shutdown()
    cluster.shutdown()
