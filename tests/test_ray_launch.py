"""``cluster.backend = "ray"`` on a private Ray cluster of three "nodes" on this machine (``ray_cluster``).

Trainer workers and engine servers run as actors where the placement plan puts them (checked from inside
them), weights pushed by the Ray workers reach the servers on the other node, a dead trainer actor ends the
run naming its rank and node, a dead server fails over, and nothing (actor, placement group, server process)
is left behind.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog.testing

from rollflow.config import load_config
from rollflow.errors import PlacementError

from .conftest import REPO_ROOT
from .helpers.waits import wait_until_sync

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def ray_config(tmp_path: Path, cluster, *extra: str, steps: int = 3):
    return load_config(
        [REPO_ROOT / "examples" / "quickstart.toml"],
        [
            f"output_dir='{tmp_path}'",
            "cluster.backend='ray'",
            f"cluster.address='{cluster.address}'",
            "cluster.placement_timeout_s=60",
            "inference.mode='http'",
            "inference.num_servers=2",
            "inference.router_port=0",
            "inference.startup_timeout_s=120",
            "trainer.num_workers=2",
            f"orchestrator.steps={steps}",
            "checkpoint.every=0",
            *extra,
        ],
    )


def alive_actors(ray) -> list[dict]:
    """Actors alive in the cluster (read from the GCS: the state API needs the dashboard, which is off)."""
    return [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]


def placement_groups(ray) -> list[dict]:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
# A hang guard, not a speed bar: 23 s quiet, past 300 s once in CI beside a busy core and a 150-step run.
@pytest.mark.timeout(1200)
async def test_a_ray_run_places_pushes_fails_over_and_fails_clearly(ray_cluster, tmp_path):
    """One run (actor start-up is the expensive part, so the checks share it), in order:
    1. each trainer rank and each server runs on the node the plan chose, with its own GPU (checked inside);
    2. two sync steps: the weights the Ray workers push reach the servers on the other node (the engines
       sample with exactly the workers' weights);
    3. a server killed: the run fails over to the other one and trains on; an error raised in the ranks
       comes back naming rank and node;
    4. a trainer actor killed: the next step fails naming its rank and node;
    5. teardown: no actor, placement group or server process is left."""
    import anyio

    from rollflow.errors import CheckpointError
    from rollflow.orchestrator import Orchestrator
    from rollflow.train.workers import TrainerWorkerError

    ray, cluster = ray_cluster
    # With a KL penalty: each rank also holds the reference policy (rollflow.train.workers.build_rank).
    config = ray_config(
        tmp_path, cluster, "inference.health_check_interval_s=0.5", "trainer.kl_coef=0.01", steps=20
    )
    orchestrator = Orchestrator(config)
    try:
        await orchestrator.setup()
        launcher = orchestrator.launcher
        plan = launcher.plan
        # 1. From inside the actors: each rank on its planned node, with the one GPU Ray gave its bundle.
        ranks = launcher.trainer.ranks
        assert [info["node_id"] for info in ranks] == [slot.node.node_id for slot in plan.workers]
        assert all(len(info["gpu_ids"]) == 1 for info in ranks)
        assert len({info["gpu_ids"][0] for info in ranks}) == 2
        assert all(info["cuda_visible_devices"] == info["gpu_ids"][0] for info in ranks)
        (servers,) = await launcher.servers_started.info()  # one node holds both servers
        assert servers["node_id"] == plan.servers[0].node.node_id == plan.servers[1].node.node_id
        assert servers["node_id"] not in {info["node_id"] for info in ranks}  # the other "node"
        assert sorted(env["CUDA_VISIBLE_DEVICES"] for env in servers["process_env"]) == ["0", "1"]
        for pid, env in zip(servers["server_pids"], servers["process_env"], strict=True):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}".encode() in environ
        assert launcher.rank0_address == ranks[0]["address"]
        urls = orchestrator.client.server_urls  # reached by URL at the node's address
        assert len(urls) == 2 and all(url.startswith(f"http://{servers['address']}:") for url in urls)

        # 2. Weights pushed by the Ray workers, sampled by the servers on the other node.
        metrics = await orchestrator.run(steps=2)
        assert [m["policy_version"] for m in metrics] == [1, 2]
        assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-7) and metrics[1]["kl"] > 0  # vs the initial
        for m in metrics:
            assert m["weight_transfer_time_s"] > 0 and math.isfinite(m["loss"])
            assert m["logprob_mismatch"] < 1e-4, m["logprob_mismatch"]

        # 3. A dead server: the router and the control plane drop it, the run goes on.
        os.killpg(servers["server_pids"][0], signal.SIGKILL)
        metrics = await orchestrator.run(steps=2)
        assert [m["policy_version"] for m in metrics] == [3, 4]

        # An error raised in the ranks comes back as itself, naming the rank and its node; they go on serving.
        with pytest.raises(CheckpointError, match="neither") as raised:
            await anyio.to_thread.run_sync(orchestrator.trainer.load_checkpoint, tmp_path / "no-checkpoint")
        assert any(
            f"trainer worker rank 0 on node {ranks[0]['address']}" in note for note in raised.value.__notes__
        )

        # 4. A dead trainer actor: the run fails, naming the rank and its node.
        victim = ranks[1]
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(
            TrainerWorkerError, match=r"trainer worker rank 1 on node \S+ \[\w+\] died during"
        ):
            await orchestrator.run(steps=1)
    finally:
        await orchestrator.stop()
    # 5. Nothing left behind.
    wait_until_sync(lambda: not alive_actors(ray), "the run's actors end", poll_s=0.2)
    assert not placement_groups(ray)
    assert not [pid for pid in servers["server_pids"] if pid_alive(pid)]


@pytest.mark.slow
async def test_placement_not_granted_fails_within_the_timeout_with_the_diagnosis(ray_cluster, tmp_path):
    """The plan fits the cluster's totals, but another job holds the GPUs: Ray never grants the groups."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rollflow.launch.launcher import open_launcher

    ray, cluster = ray_cluster
    holder = placement_group([{"GPU": 2}, {"GPU": 2}], strategy="SPREAD")
    ray.get(holder.ready(), timeout=30)
    try:
        config = ray_config(tmp_path, cluster, "cluster.placement_timeout_s=3")
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs, pytest.raises(PlacementError) as caught:
            async with open_launcher(config):
                pass
        elapsed = time.monotonic() - started
    finally:
        remove_placement_group(holder)
    message = str(caught.value)
    assert elapsed < 3 + 30, elapsed  # at the timeout, not never; generous, for a loaded machine
    assert "cluster.placement_timeout_s = 3" in message
    assert "2 trainer worker(s)" in message and "2 server(s)" in message  # the demand
    assert "0 GPU free" in message or "0 GPU" in message  # what the cluster has free
    assert "trainer.num_workers" in message
    progress = [entry for entry in logs if entry["event"] == "waiting for Ray placement groups"]
    assert progress and "trainer workers" in progress[0]["pending"]  # logged while waiting, not silent
    assert not placement_groups(ray)


async def test_infeasible_plan_fails_before_any_actor_starts(ray_cluster, tmp_path):
    from rollflow.launch.launcher import open_launcher

    ray, cluster = ray_cluster
    config = ray_config(tmp_path, cluster, "trainer.num_workers=5")
    with pytest.raises(PlacementError, match=r"trainer.num_workers = 5 needs one GPU per worker.*4 GPU"):
        async with open_launcher(config):
            pass
    assert not placement_groups(ray)
    assert not alive_actors(ray)


def test_unreachable_address_is_a_clear_error_within_seconds(tmp_path):
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow",
            "run",
            str(REPO_ROOT / "examples" / "quickstart.toml"),
            "--set",
            "cluster.backend='ray'",
            "--set",
            "cluster.address='127.0.0.1:1'",
            "--set",
            f"output_dir='{tmp_path}'",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cluster.address = '127.0.0.1:1': cannot reach the Ray cluster" in result.stderr
    assert time.monotonic() - started < 60


PRIVATE = """
import os, time
from pathlib import Path
from rollflow.config import load_config
from rollflow.launch.ray_cluster import connect_ray

def running(pids):
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive

def descendants():
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found

config = load_config([], ["cluster.backend='ray'", "cluster.num_cpus=1"])
connection = connect_ray(config.cluster, 60)
started = descendants()
time.sleep(2)  # long after the connecting call returned
print("ALIVE", len(running(started)), len(started))
connection.close()
deadline = time.monotonic() + 60  # they go once close() returns, a moment later
while running(started) and time.monotonic() < deadline:
    time.sleep(0.1)
print("LEFT", len(running(started)))  # any parent: an orphan left behind counts
"""


DRIVER = """
import asyncio, json, sys, threading
from rollflow.config import load_config
from rollflow.launch.launcher import open_launcher

async def main():
    config = load_config([], sys.argv[2:])
    async with open_launcher(config, trainer=sys.argv[1] == "with-trainer") as launcher:
        async with launcher.servers("rollflow:tiny", 1, sys.argv[0] + "-logs", startup_timeout_s=120):
            pids = [pid for info in await launcher.servers_started.info() for pid in info["server_pids"]]
            print("STARTED", json.dumps({"server_pids": pids}), flush=True)
            # A line on stdin: exit normally (read in a daemon thread, which Ctrl-C's shutdown does not wait for).
            loop, line = asyncio.get_running_loop(), asyncio.Event()
            read = lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(line.set))
            threading.Thread(target=read, daemon=True).start()
            await line.wait()

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_driver_that_exits_is_interrupted_or_killed_leaves_nothing_behind(ray_cluster, tmp_path):
    """Three drivers at once (each a server and a trainer bundle on the CPU): one exits normally (servers only,
    as ``rollflow generate``), one gets Ctrl-C (the launcher's teardown ends its actors and placement groups),
    one gets SIGKILL (it runs no teardown of its own: Ray ends its job's actors and placement groups, its
    server dies with the launcher's process).

    Meanwhile (they share the wait) a fourth process starts a private instance (``address = "local"``): Ray's
    processes outlive the call that started them (Ray ties them to the starting thread, so that thread lives
    until the run ends) and are gone after ``close``."""
    import json

    private = subprocess.Popen(
        [sys.executable, "-c", PRIVATE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    ray, cluster = ray_cluster
    options = [
        "cluster.backend='ray'",
        f"cluster.address='{cluster.address}'",
        "cluster.cpus_per_worker=0.5",
        "cluster.cpus_per_server=0.5",
        "trainer.device='cpu'",
        "inference.device='cpu'",
        "inference.mode='http'",
        "inference.num_servers=1",
        "trainer.num_workers=1",
    ]
    endings = {"exit": None, "ctrl-c": signal.SIGINT, "kill-9": signal.SIGKILL}
    drivers = {
        ending: subprocess.Popen(
            [sys.executable, "-c", DRIVER, "servers-only" if ending == "exit" else "with-trainer", *options],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for ending in endings
    }
    started = {}
    try:
        for ending, driver in drivers.items():
            while not (line := driver.stdout.readline()).startswith("STARTED "):
                assert line, driver.stderr.read()[-3000:]
            started[ending] = json.loads(line.removeprefix("STARTED "))["server_pids"]
            assert len(started[ending]) == 1 and pid_alive(started[ending][0])
        # Each: its server node's, and the trainer's but for the servers-only one (as `rollflow generate`).
        assert len(placement_groups(ray)) == 2 * len(drivers) - 1
        for ending, driver in drivers.items():
            if endings[ending] is None:
                driver.stdin.write("\n")
                driver.stdin.flush()
            else:
                driver.send_signal(endings[ending])
        for driver in drivers.values():
            driver.wait(60)
    finally:
        for driver in drivers.values():
            driver.kill()
            driver.wait()
    assert drivers["exit"].returncode == 0, drivers["exit"].stderr.read()[-3000:]
    assert drivers["ctrl-c"].returncode != 0  # KeyboardInterrupt, after the teardown
    for ending, pids in started.items():
        wait_until_sync(
            lambda pids=pids: not any(pid_alive(pid) for pid in pids),
            f"the {ending} driver's server ends",
            poll_s=0.2,
        )
    wait_until_sync(lambda: not alive_actors(ray), "the drivers' actors end", poll_s=0.2)
    wait_until_sync(lambda: not placement_groups(ray), "the drivers' placement groups go", poll_s=0.2)
    out, err = private.communicate(timeout=120)
    assert private.returncode == 0, err[-3000:]
    alive = next(line for line in out.splitlines() if line.startswith("ALIVE")).split()
    assert int(alive[1]) == int(alive[2]) > 0  # gcs, raylet, ... all still running
    assert next(line for line in out.splitlines() if line.startswith("LEFT")) == "LEFT 0"
