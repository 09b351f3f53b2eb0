"""The transport half on two trainer ranks holding DTensor shards (a real gloo group of 2 processes): every
rank joins each ``full_tensor()`` gather, only rank 0 sends, and the servers get the full weights."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
import torch

from rollflow.weights import WeightTransfer, WeightTransferError, create_strategy

from .helpers.weights import ThreadClient, assert_same_weights


def full_weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 8, generator=generator)),  # uneven shards
        ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 3, generator=generator)),
        ("model.norm.weight", torch.randn(7, generator=generator)),
        ("scalar", torch.tensor(3.5)),  # replicated
    ]


def _serve_rank(rank: int, port: int, conn: Any) -> None:
    """One trainer rank: a gloo default group of 2, its shards as DTensors, and transport calls from the pipe."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    sharded = [
        (name, distribute_tensor(tensor, mesh, [Shard(0) if tensor.dim() else Replicate()]))
        for name, tensor in full_weights()
    ]
    assert sharded[0][1].to_local().shape[0] < 11  # really sharded
    conn.send("ready")
    while (call := conn.recv()) is not None:
        try:
            conn.send(("ok", call(rank, iter(sharded))))
        except Exception as error:
            conn.send(("error", error))
    dist.destroy_process_group()


class TwoRanks:
    """A worker-group handle: ``push_weights`` runs the call on both ranks at once, returns rank 0's result."""

    def __init__(self) -> None:
        from rollflow.launch.server_group import free_port

        context = multiprocessing.get_context("spawn")
        port = free_port()
        self.conns, self.processes = [], []
        for rank in range(2):
            parent, child = context.Pipe()
            process = context.Process(target=_serve_rank, args=(rank, port, child), daemon=True)
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        for conn in self.conns:
            if not conn.poll(120):
                raise RuntimeError("a trainer rank did not start")
            conn.recv()

    def push_weights(self, call: Any) -> Any:
        for conn in self.conns:
            conn.send(call)
        replies = [conn.recv() for conn in self.conns]
        for status, value in replies:
            if status == "error":
                raise value
        return replies[0][1]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for process in self.processes:
            process.join(30)


@pytest.fixture(scope="module")
def two_ranks():
    ranks = TwoRanks()
    yield ranks
    ranks.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["broadcast", "checkpoint"])
async def test_two_ranks_gather_and_rank_0_sends(two_ranks, strategy):
    options = {"backend": "gloo", "bucket_size_mb": 100 / 2**20} if strategy == "broadcast" else {}
    client = ThreadClient(2)
    transfer = WeightTransfer(create_strategy(strategy, timeout_s=60, dtype="bfloat16", **options))
    try:
        for version in (1, 2):
            await transfer.push(client, two_ranks, policy_version=version)
            expected = [(name, tensor.to(torch.bfloat16)) for name, tensor in full_weights()]
            for received in client.received:
                assert_same_weights(expected, received)
    finally:
        transfer.close()
        client.close()


def test_a_rank_that_fails_is_named(two_ranks):
    with pytest.raises(WeightTransferError, match=r"trainer rank 1: .*out of memory gathering a layer"):
        two_ranks.push_weights(_FailOnRank())


class _FailOnRank:
    """A transport call that fails on rank 1 only (as a gather that runs out of memory there would)."""

    def __call__(self, rank: int, named_weights: Any) -> Any:
        from rollflow.weights import TransportCall

        return TransportCall(_Raises(), "push")(rank, named_weights) if rank == 1 else None


class _Raises:
    def push(self, rank: int, named_weights: Any) -> None:
        raise RuntimeError("out of memory gathering a layer")
