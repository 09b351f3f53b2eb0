"""The placement plan (pure), the [cluster] keys, and ``rollflow run --dry-run`` printing the plan."""

from __future__ import annotations

import builtins
import re
import subprocess
import sys

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError, MissingExtraError, PlacementError
from rollflow.launch.plan import Demand, Node, make_plan

from .conftest import REPO_ROOT


def gpu_nodes(*gpus: int, cpus: float = 16, head_gpus: int | None = None) -> list[Node]:
    nodes = [Node(f"node{i:04d}", f"10.0.0.{i + 1}", cpus, g) for i, g in enumerate(gpus)]
    if head_gpus is not None:
        nodes.insert(0, Node("head0000", "10.0.0.100", cpus, head_gpus, head=True))
    return nodes


def demand(workers=2, servers=2, tp=1, worker_gpus=1, server_gpus=None, cpus=1.0, colocate=False) -> Demand:
    return Demand(
        num_workers=workers,
        worker_gpus=worker_gpus,
        worker_cpus=cpus,
        num_servers=servers,
        server_gpus=tp if server_gpus is None else server_gpus,
        server_cpus=cpus,
        colocate=colocate,
    )


def test_two_nodes_of_eight_trainer_packs_one_servers_fill_the_rest():
    plan = make_plan(demand(workers=8, servers=4, tp=2), gpu_nodes(8, 8))
    assert {slot.node.node_id for slot in plan.workers} == {"node0000"}
    assert [slot.rank for slot in plan.workers] == list(range(8))
    assert plan.rank0_node.node_id == "node0000"
    assert {slot.node.node_id for slot in plan.servers} == {"node0001"}
    assert all(slot.bundle.resources() == {"CPU": 1.0, "GPU": 2} for slot in plan.servers)
    assert [s.index for s in plan.servers_by_node()["node0001"]] == [0, 1, 2, 3]


def test_trainer_spans_nodes_rank0_on_the_first_and_never_on_a_gpu_less_head():
    plan = make_plan(demand(workers=12, servers=2), gpu_nodes(8, 8, head_gpus=0))
    per_node = {}
    for slot in plan.workers:
        per_node.setdefault(slot.node.node_id, []).append(slot.rank)
    assert per_node == {"node0000": list(range(8)), "node0001": list(range(8, 12))}
    assert plan.rank0_node.node_id == "node0000"
    assert all(slot.node.node_id == "node0001" for slot in plan.servers)
    assert "unused" in plan.describe().splitlines()[-1]  # the head: no GPU work for it


def test_head_wins_a_tie_for_rank0():
    plan = make_plan(demand(workers=1, servers=1), gpu_nodes(4, head_gpus=4))
    assert plan.rank0_node.head
    assert plan.servers[0].node.node_id == "node0000"  # most free GPUs after the trainer took one


def test_servers_spread_over_free_nodes():
    # Servers only (rollflow generate / eval on Ray): no trainer bundles.
    plan = make_plan(demand(workers=0, servers=4), gpu_nodes(2, 2))
    assert [slot.node.node_id for slot in plan.servers] == ["node0000", "node0001", "node0000", "node0001"]
    assert plan.to_dict()["rank0_node"] is None and not plan.to_dict()["workers"]
    assert "trainer ranks" not in plan.describe()


def test_cpu_cluster_bundles_hold_cpus_only():
    nodes = [Node("a" * 8, "10.0.0.1", 2), Node("b" * 8, "10.0.0.2", 2)]
    plan = make_plan(demand(workers=2, servers=2, worker_gpus=0, server_gpus=0), nodes)
    assert [slot.node.node_id for slot in plan.workers] == ["a" * 8, "a" * 8]
    assert [slot.node.node_id for slot in plan.servers] == ["b" * 8, "b" * 8]
    assert plan.workers[0].bundle.resources() == {"CPU": 1.0}


def test_more_workers_than_gpus_names_keys_demand_and_nodes():
    with pytest.raises(PlacementError) as caught:
        make_plan(demand(workers=20, servers=0), gpu_nodes(8, 8))
    message = str(caught.value)
    assert "trainer.num_workers = 20" in message and "16 GPU" in message
    assert "10.0.0.1" in message and "10.0.0.2" in message and "8 GPU" in message
    assert "20 trainer worker(s)" in message


def test_tensor_parallel_group_larger_than_a_node():
    with pytest.raises(PlacementError, match=r"inference.tensor_parallel_size = 16.*largest node has 8 GPU"):
        make_plan(demand(workers=1, servers=1, tp=16), gpu_nodes(8, 8))


def test_servers_that_do_not_fit_after_the_trainer():
    with pytest.raises(PlacementError, match=r"only 2 of inference.num_servers = 3 .*inference.num_servers"):
        make_plan(demand(workers=4, servers=3, tp=2), gpu_nodes(4, 4))


def test_cpus_that_do_not_fit():
    with pytest.raises(PlacementError, match=r"only 2 of trainer.num_workers = 3.*cluster.cpus_per_worker"):
        make_plan(demand(workers=3, servers=0, worker_gpus=0, cpus=1.0), [Node("a" * 8, "10.0.0.1", 2)])


def test_colocated_servers_share_worker_gpus_on_one_node():
    plan = make_plan(demand(workers=8, servers=4, tp=2, colocate=True), gpu_nodes(4, 4))
    assert [slot.worker_ranks for slot in plan.servers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for slot in plan.servers:
        assert {plan.workers[r].node.node_id for r in slot.worker_ranks} == {slot.node.node_id}
        assert slot.bundle.resources() == {"CPU": 1.0}  # no GPUs of its own
    assert "sharing 2 trainer GPU(s)" in plan.demand.describe()


def test_colocated_tp_group_cannot_straddle_nodes():
    # 3 workers per node: a TP-2 group fits once per node, so 2 servers, not 3.
    with pytest.raises(PlacementError, match="inference.colocate = true.*room for 2 server"):
        make_plan(demand(workers=6, servers=3, tp=2, colocate=True), gpu_nodes(3, 3))


def test_colocate_on_cpu_trainer_with_gpu_servers_is_refused():
    with pytest.raises(PlacementError, match="trainer.device"):
        make_plan(demand(workers=2, servers=2, worker_gpus=0, server_gpus=1, colocate=True), gpu_nodes(2))


def test_no_nodes():
    with pytest.raises(PlacementError, match="ray start --head"):
        make_plan(demand(), [])


def test_describe_lists_every_node_and_rank0():
    plan = make_plan(demand(workers=3, servers=2), gpu_nodes(2, 4))
    text = plan.describe()
    assert text.splitlines()[0].startswith("placement plan: 3 trainer worker(s)")
    lines = text.splitlines()[1:]
    # The 4-GPU node first: the trainer fills it; the servers go where most GPUs are left.
    assert (
        lines[0]
        == "  10.0.0.2 [node0001]: 16 CPU, 4 GPU: trainer ranks 0-2 (rank 0: rendezvous, weight sender)"
    )
    assert lines[1] == "  10.0.0.1 [node0000]: 16 CPU, 2 GPU: servers 0-1"
    assert plan.to_dict()["rank0_node"] == "node0001"


# ---------------------------------------------------------------- demand from the config


def test_demand_from_config_gpu_cluster_and_external_servers():
    config = load_config(
        overrides=[
            "cluster.backend='ray'",
            "inference.mode='http'",
            "trainer.num_workers=4",
            "inference.num_servers=3",
            "cluster.cpus_per_server=2",
        ]
    )
    gpu = Demand.from_config(config, gpu_nodes(8))
    assert (gpu.num_workers, gpu.worker_gpus, gpu.num_servers, gpu.server_gpus, gpu.server_cpus) == (
        4,
        1,
        3,
        1,
        2,
    )
    cpu = Demand.from_config(config, [Node("a" * 8, "10.0.0.1", 8)])
    assert (cpu.worker_gpus, cpu.server_gpus) == (0, 0)
    external = load_config(
        overrides=[
            "cluster.backend='ray'",
            "inference.mode='http'",
            "inference.external_server_urls=['http://h:1']",
        ]
    )
    assert Demand.from_config(external, gpu_nodes(8)).num_servers == 0
    local = load_config(overrides=["cluster.backend='ray'", "inference.mode='local'"])
    assert Demand.from_config(local, gpu_nodes(8)).num_servers == 0


# ---------------------------------------------------------------- [cluster] keys


def test_cluster_defaults_are_local():
    config = load_config()
    assert config.cluster.backend == "local"
    assert config.cluster.address == "local"
    assert config.weight_sync.master_address == "auto"
    assert config.weight_sync.strategy_options("broadcast")["master_address"] == "127.0.0.1"
    assert (
        config.weight_sync.strategy_options("broadcast", rank0_address="10.1.2.3")["master_address"]
        == "10.1.2.3"
    )


@pytest.mark.parametrize(
    "address", ["local", "auto", "10.0.0.1:6379", "ray://head.example:10001", "[::1]:6379"]
)
def test_cluster_addresses_accepted(address):
    assert (
        load_config(overrides=["cluster.backend='ray'", f"cluster.address='{address}'"]).cluster.address
        == address
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.backend='ray'", "cluster.address='head'"], "cluster.address = 'head'"),
        (["cluster.backend='ray'", "cluster.address='http://h:1'"], "cluster.address"),
        (["cluster.backend='slurm'"], "cluster.backend"),
        (["cluster.address='auto'"], "cluster.address only apply to cluster.backend = 'ray'"),
        (["cluster.env={A='1'}"], "cluster.env only apply"),
        (["cluster.backend='ray'", "cluster.env={'1A'='x'}"], "cluster.env has '1A'"),
        (["cluster.backend='ray'", "cluster.address='auto'", "cluster.num_cpus=2"], "cluster.num_cpus"),
        (["cluster.backend='ray'", "trainer.placement='process'"], "trainer.placement = 'process'"),
        (["cluster.placement_timeout_s=0"], "cluster.placement_timeout_s"),
        (["cluster.cpus_per_worker=-1"], "cluster.cpus_per_worker"),
        (["cluster.placement_timeout_s=inf"], "cluster.placement_timeout_s"),
    ],
)
def test_bad_cluster_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


@pytest.fixture
def without_ray(monkeypatch):
    """Imports of ``ray`` fail, as on a machine without the extra."""
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    monkeypatch.delitem(sys.modules, "ray", raising=False)


def test_missing_ray_names_the_key_and_install(without_ray):
    from rollflow.launch import ray_cluster

    config = load_config(overrides=["cluster.backend='ray'"])
    with pytest.raises(MissingExtraError, match=r"cluster.backend = 'ray'.*pip install 'rollflow\[ray\]'"):
        ray_cluster.dry_run_plan(config)


async def test_missing_ray_fails_the_launcher_before_anything_starts(without_ray):
    from rollflow.launch.launcher import open_launcher

    config = load_config(overrides=["cluster.backend='ray'", "cluster.address='auto'"])
    with pytest.raises(MissingExtraError, match=r"cluster.backend = 'ray'.*pip install 'rollflow\[ray\]'"):
        async with open_launcher(config):
            pass


def test_unreachable_address_fails_fast_naming_the_key():
    from rollflow.launch.ray_cluster import probe_address

    with pytest.raises(PlacementError, match=r"cluster.address = '127.0.0.1:1'.*ray start --head"):
        probe_address("127.0.0.1:1")


def test_actor_env_forwards_patterns_and_env_wins():
    from rollflow.launch.ray_cluster import actor_env

    config = load_config(overrides=["cluster.backend='ray'", "cluster.env={NCCL_DEBUG='WARN', X='1'}"])
    environ = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "HF_HOME": "/hf", "HOME": "/root"}
    assert actor_env(config.cluster, environ) == {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "eth0",
        "HF_HOME": "/hf",
        "X": "1",
    }


def _dry_run(directory, *overrides: str) -> subprocess.CompletedProcess:
    """``rollflow run examples/quickstart.toml --set cluster.backend='ray' --set … --dry-run`` in ``directory``."""
    command = [sys.executable, "-m", "rollflow", "run", str(REPO_ROOT / "examples" / "quickstart.toml")]
    for override in ("cluster.backend='ray'", *overrides):
        command += ["--set", override]
    return subprocess.run([*command, "--dry-run"], capture_output=True, text=True, cwd=directory, timeout=60)


def test_cli_dry_run_prints_the_plan(tmp_path):
    result = _dry_run(tmp_path, "cluster.num_cpus=4", "inference.mode='http'", "trainer.num_workers=2")
    assert result.returncode == 0, result.stderr
    assert "placement plan: 2 trainer worker(s)" in result.stderr
    assert "trainer ranks 0-1 (rank 0: rendezvous, weight sender); servers 0-1" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_dry_run_infeasible_plan_exits_2(tmp_path):
    result = _dry_run(tmp_path, "cluster.num_cpus=2", "trainer.num_workers=3")
    assert result.returncode == 2, result.stderr
    assert "trainer.num_workers = 3" in result.stderr and "127.0.0.1" in result.stderr
