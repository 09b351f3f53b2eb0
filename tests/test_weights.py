"""Weight transfer: packing, the broadcast and checkpoint strategies end to end, failures and timeouts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rollflow.inference.control import WorldSize
from rollflow.weights import (
    InvalidTransferInfoError,
    StaticWeights,
    WeightTransfer,
    WeightTransferError,
    WeightTransferTimeoutError,
    connect_sender,
    create_strategy,
    init_info_for_servers,
)
from rollflow.weights.packing import pack, plan_buckets, specs_from_info, specs_of, specs_to_info, unpack
from rollflow.weights.server.receiver import create_receiver

from .helpers.gpus import needs_two_gpus
from .helpers.weights import ThreadClient, assert_same_weights, fake_world

# How much later than its timeout a bounded wait may end: generous, for a loaded machine.
LATE_S = 10.0


def mixed_weights() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, including an odd-length bf16 tensor that misaligns what follows it."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 8, generator=generator)),
        ("model.norm.weight", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 3, generator=generator).to(torch.float16)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("counts", torch.arange(-4, 5, dtype=torch.int64).reshape(3, 3)),
        ("flags", torch.tensor([True, False, True])),
        ("empty", torch.empty(0, 4)),
        ("transposed", torch.randn(4, 6, generator=generator).t()),  # not contiguous
    ]


def test_strategy_interface_does_not_import_torch() -> None:
    """The orchestrator and config import ``rollflow.weights`` to pick a strategy; that must stay cheap."""
    code = "import sys, rollflow.weights, rollflow.weights.base; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_create_strategy_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="unknown weight transfer strategy 'nccl'; choose one of local"):
        create_strategy("nccl")
    with pytest.raises(ValueError, match="bucket_size_mb must be positive"):
        create_strategy("broadcast", bucket_size_mb=0)
    with pytest.raises(TypeError):
        create_strategy("checkpoint", bucket_size_mb=1)
    # cuda_ipc takes the inference world size and ignores it.
    strategy = create_strategy("cuda_ipc")
    assert strategy.create_sender(1).init_info == strategy.create_sender(8).init_info
    with pytest.raises(ValueError, match="weight_sync.dtype must be one of auto, float32"):
        create_strategy("broadcast", dtype="fp8")


def test_weight_sync_dtype_is_checked_and_reaches_every_strategy() -> None:
    from rollflow.config import load_config
    from rollflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"weight_sync\.dtype"):
        load_config([], ["weight_sync.dtype='fp8'"])
    config = load_config([], ["inference.mode='http'", "weight_sync.dtype='bfloat16'"])
    for strategy in ("broadcast", "checkpoint", "cuda_ipc"):
        options = config.weight_sync.strategy_options(strategy)
        assert options["dtype"] == "bfloat16"
        assert create_strategy(strategy, **options).dtype == "bfloat16"


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("bucket_size_bytes", [1, 40, 100, 10**9])
def test_pack_unpack_is_exact_for_mixed_dtypes_and_shapes(bucket_size_bytes: int) -> None:
    weights = mixed_weights()
    specs = specs_of(weights)
    buckets = plan_buckets(specs, bucket_size_bytes)
    assert [i for bucket in buckets for i in bucket] == list(range(len(specs)))  # in order, each once
    for bucket in buckets[:-1]:
        sizes = [specs[i].nbytes for i in bucket]
        # A bucket closes as soon as it reaches the size, not before.
        assert sum(sizes) >= bucket_size_bytes > sum(sizes[:-1])
    received = []
    for bucket in buckets:
        buffer = pack([weights[i][1] for i in bucket])
        assert buffer.dtype == torch.uint8
        received += unpack(buffer.clone(), [specs[i] for i in bucket])
    assert_same_weights(weights, received)
    # The metadata survives its JSON form.
    assert specs_from_info(json.loads(json.dumps(specs_to_info(specs)))) == specs


def test_update_info_validation_names_the_problem() -> None:
    info = specs_to_info(specs_of(mixed_weights()))
    with pytest.raises(InvalidTransferInfoError, match="equal lengths"):
        specs_from_info({**info, "shapes": info["shapes"][:-1]})
    with pytest.raises(InvalidTransferInfoError, match="not a torch dtype"):
        specs_from_info({**info, "dtype_names": ["float99"] * len(info["names"])})
    with pytest.raises(InvalidTransferInfoError, match="names must be a list"):
        specs_from_info({"dtype_names": [], "shapes": []})
    with pytest.raises(InvalidTransferInfoError, match="packed buffer has 3 bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), specs_of(mixed_weights()[:1]))


def test_create_receiver_rejects_bad_init_info() -> None:
    with pytest.raises(InvalidTransferInfoError, match="backend"):
        create_receiver({"backend": "carrier-pigeon"}, 0)
    with pytest.raises(InvalidTransferInfoError, match="JSON object"):
        create_receiver(["gloo"], 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferInfoError, match="missing or has a bad field"):
        create_receiver({"backend": "gloo", "world_size": 2}, 0)
    info = {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": 1,
        "world_size": 2,
        "rank_offset": 1,
    }
    with pytest.raises(InvalidTransferInfoError, match=r"rank 2 .* outside 1..1"):
        create_receiver(info, 1)


def test_init_info_for_servers_gives_each_server_its_own_ranks() -> None:
    info = {"backend": "gloo", "world_size": 5, "rank_offset": 1, "master_port": 1}
    offsets = [p["rank_offset"] for p in init_info_for_servers(info, num_servers=4, workers_per_server=1)]
    assert offsets == [1, 2, 3, 4]
    # vLLM data parallelism: one server per DP rank, each reporting its whole deployment of 2 workers.
    offsets = [
        p["rank_offset"]
        for p in init_info_for_servers(info, num_servers=4, workers_per_server=2, data_parallel_size=2)
    ]
    assert offsets == [1, 1, 3, 3]
    with pytest.raises(InvalidTransferInfoError, match="do not match init_info world_size 5"):
        init_info_for_servers(info, num_servers=3, workers_per_server=1)
    payloads = init_info_for_servers({"backend": "checkpoint"}, num_servers=2, workers_per_server=1)
    assert payloads == [{"backend": "checkpoint"}] * 2


# ---------------------------------------------------------------- fake clients

RECEIVER_PROCESS = """
import json, sys
replies, sys.stdout = sys.stdout, sys.stderr  # keep log lines out of the reply stream
from safetensors.torch import save_file
from rollflow.weights.server.receiver import create_receiver
receiver = None
for line in sys.stdin:
    message = json.loads(line)
    try:
        if message["op"] == "init":
            receiver = create_receiver(message["init_info"], 0)
            reply = {"ok": True}
        else:
            tensors = receiver.receive(message["update_info"])
            save_file({name: tensor.clone() for name, tensor in tensors}, message["out"])
            reply = {"ok": True}
    except Exception as exc:
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(reply), file=replies, flush=True)
"""


class ProcessClient:
    """Stands in for RemoteInferenceClient: each 'server' is a subprocess running a receiver; the calls block
    on the receivers like the HTTP endpoints do."""

    def __init__(self, num_servers: int, out_dir: Path):
        self.num_servers = num_servers
        self.out_dir = out_dir
        self.processes: list[asyncio.subprocess.Process] = []
        self.updates = 0

    async def start(self) -> None:
        self.processes = list(
            await asyncio.gather(
                *[
                    asyncio.create_subprocess_exec(
                        sys.executable,
                        "-c",
                        RECEIVER_PROCESS,
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                    )
                    for _ in range(self.num_servers)
                ]
            )
        )

    async def _call(self, process: asyncio.subprocess.Process, message: dict[str, Any]) -> None:
        process.stdin.write((json.dumps(message) + "\n").encode())
        await process.stdin.drain()
        reply = json.loads(await process.stdout.readline())
        if not reply["ok"]:
            raise WeightTransferError(reply["error"])

    @property
    def server_urls(self) -> list[str]:
        return [f"fake://server{i}" for i in range(self.num_servers)]

    async def world_size(self) -> WorldSize:
        return fake_world(self.num_servers, self.server_urls)

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        payloads = init_info if isinstance(init_info, list) else [init_info] * self.num_servers
        await asyncio.gather(
            *[
                self._call(p, {"op": "init", "init_info": info})
                for p, info in zip(self.processes, payloads, strict=True)
            ]
        )

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updates += 1
        await asyncio.gather(
            *[
                self._call(p, {"op": "update", "update_info": update_info, "out": str(self.received_path(i))})
                for i, p in enumerate(self.processes)
            ]
        )

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        pass

    def received_path(self, server: int) -> Path:
        return self.out_dir / f"server{server}-update{self.updates}.safetensors"

    async def close(self) -> None:
        for process in self.processes:
            process.stdin.close()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


# ---------------------------------------------------------------- broadcast


class Holder:
    """Weights a test changes between pushes, behind a ``StaticWeights`` trainer handle."""

    def __init__(self, weights: list[tuple[str, torch.Tensor]]):
        self.weights = weights
        self.source = StaticWeights(lambda: self.weights)


@pytest.mark.slow
async def test_broadcast_gloo_round_trip_to_receiver_processes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    client = ProcessClient(2, tmp_path)
    await client.start()
    holder = Holder(mixed_weights())
    # A 100-byte bucket splits the weights into several broadcasts.
    sender = await connect_sender(
        create_strategy("broadcast", backend="gloo", bucket_size_mb=100 / 2**20, timeout_s=30),
        client,
        holder.source,
    )
    try:
        assert sender.init_info["world_size"] == 3
        for version in (1, 2):
            holder.weights = [(n, t if t.dtype == torch.bool else t * version) for n, t in mixed_weights()]
            await sender.push(client, holder.source, policy_version=version)
            for server in range(2):
                assert_same_weights(holder.weights, list(load_file(client.received_path(server)).items()))
    finally:
        sender.close()
        await client.close()


async def test_broadcast_casts_floating_weights_to_the_transfer_dtype() -> None:
    client = ThreadClient(1)
    holder = Holder(mixed_weights())
    transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=30, dtype="bfloat16"))
    try:
        await transfer.push(client, holder.source, policy_version=1)
        expected = [(n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in mixed_weights()]
        assert_same_weights(expected, client.received[0])
    finally:
        transfer.close()
        client.close()


@pytest.mark.parametrize("strategy", ["broadcast", "checkpoint"])
async def test_a_wildcard_address_binds_every_interface_and_advertises_this_host(strategy: str) -> None:
    from rollflow.weights.broadcast import advertised_address

    host = advertised_address("0.0.0.0")
    assert host not in ("0.0.0.0", "")
    client = ThreadClient(1)
    options = (
        {"backend": "gloo", "master_address": "0.0.0.0"} if strategy == "broadcast" else {"host": "0.0.0.0"}
    )
    transfer = WeightTransfer(create_strategy(strategy, timeout_s=30, **options))
    try:
        await transfer.push(client, StaticWeights(mixed_weights), policy_version=1)
        assert_same_weights(mixed_weights(), client.received[0])
        if strategy == "broadcast":
            assert transfer.sender.init_info["master_address"] == host
    finally:
        transfer.close()
        client.close()


async def test_broadcast_world_size_mismatch_is_a_clear_error() -> None:
    strategy = create_strategy("broadcast", backend="gloo", timeout_s=5)
    sender = strategy.create_sender(inference_world_size=1)
    source = StaticWeights(mixed_weights)
    try:
        with pytest.raises(WeightTransferError, match="report 2 workers but this sender was made for 1"):
            await sender.setup(ThreadClient(2), source)
        with pytest.raises(WeightTransferError, match="unusable"):
            await sender.push(ThreadClient(2), source, 1)
    finally:
        sender.close()


def rank_claimed(init_info: dict[str, Any], worker_rank: int) -> None:
    """Block until a broadcast receiver of ``init_info`` holds its rank in the trainer's store (60 s at most)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    address, port = init_info["master_address"], int(init_info["master_port"])
    store = dist.PrefixStore(
        init_info["group_name"], dist.TCPStore(address, port, is_master=False, timeout=timeout)
    )
    store.wait([f"rank/{int(init_info.get('rank_offset', 1)) + worker_rank}"], timeout)


@pytest.mark.slow
async def test_broadcast_receiver_rejects_a_rank_taken_twice() -> None:
    class SameRanks(ThreadClient):
        """Gives both servers the first server's payload (rank_offset not advanced)."""

        async def init_weight_transfer(self, init_info: Any) -> None:
            info = init_info[0] if isinstance(init_info, list) else init_info
            first = asyncio.create_task(asyncio.to_thread(create_receiver, info, 0))
            await asyncio.to_thread(rank_claimed, info, 0)  # the first holds its rank before the second asks
            try:
                await asyncio.to_thread(create_receiver, info, 0)
            finally:
                first.cancel()

    with pytest.raises(InvalidTransferInfoError, match="rank 1 was already taken"):
        await connect_sender(
            create_strategy("broadcast", backend="gloo", timeout_s=2),
            SameRanks(2),
            StaticWeights(mixed_weights),
        )


@pytest.mark.slow
async def test_broadcast_hung_receiver_ends_in_a_timeout_error_naming_what_is_pending() -> None:
    timeout_s = 1.5
    # The servers accept /update_weights, then never receive: the push must end, not hang.
    client = ThreadClient(1, hang_update=True)
    source = StaticWeights(lambda: [("w", torch.ones(1_000_000))])
    sender = await connect_sender(
        create_strategy("broadcast", backend="gloo", timeout_s=timeout_s), client, source
    )
    try:
        started = time.perf_counter()
        with pytest.raises(
            WeightTransferTimeoutError, match=r"policy version 7 .* longer than 1.5 s.*fake://server0"
        ):
            await sender.push(client, source, policy_version=7)
        assert time.perf_counter() - started < timeout_s + LATE_S
        assert isinstance(WeightTransferTimeoutError("x"), TimeoutError)  # what the barrier catches
        with pytest.raises(WeightTransferError, match="unusable"):
            await sender.push(client, source, policy_version=8)
    finally:
        sender.close()
        client.close()


@pytest.mark.slow
async def test_weight_transfer_reconnects_after_a_failed_push() -> None:
    from rollflow.weights.trainer import sessions as transport

    client = ThreadClient(1, hang_update=True)
    transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=1))
    holder = Holder([("w", torch.ones(1_000_000))])
    try:
        with pytest.raises(WeightTransferTimeoutError):
            await transfer.push(client, holder.source, policy_version=1)
        assert transfer.sender is None
        client.close()
        client.hang_update = False
        holder.weights = mixed_weights()  # a new connection reads the weights' metadata afresh
        await transfer.push(client, holder.source, policy_version=2)  # a new group, new receivers
        assert_same_weights(holder.weights, client.received[0])
        # The failed connection's trainer-side session was released by the new one's open.
        assert [key[0] for key in transport._sessions] == [transfer.sender.transfer_id]
    finally:
        transfer.close()
        client.close()
    assert not transport._sessions


@pytest.mark.slow
async def test_broadcast_receiver_times_out_when_the_trainer_never_sends() -> None:
    timeout_s = 1.5
    client = ThreadClient(1)
    sender = await connect_sender(
        create_strategy("broadcast", backend="gloo", timeout_s=timeout_s),
        client,
        StaticWeights(mixed_weights),
    )
    try:
        started = time.perf_counter()
        with pytest.raises(WeightTransferTimeoutError, match="receiving a weight bucket"):
            await asyncio.to_thread(
                client.receivers[0].receive, specs_to_info(specs_of([("w", torch.ones(3))]))
            )
        assert time.perf_counter() - started < timeout_s + LATE_S
        with pytest.raises(WeightTransferError, match="must initialize a new one"):
            client.receivers[0].receive(specs_to_info(specs_of([("w", torch.ones(3))])))
    finally:
        sender.close()
        client.close()


@pytest.mark.slow
async def test_broadcast_setup_times_out_naming_the_servers_that_never_joined() -> None:
    started = time.perf_counter()
    with pytest.raises(
        WeightTransferTimeoutError,
        match=r"forming the weight-transfer group .* the servers \(fake://server0\)",
    ):
        await connect_sender(
            create_strategy("broadcast", backend="gloo", timeout_s=1),
            ThreadClient(1, join=False),
            StaticWeights(mixed_weights),
        )
    assert time.perf_counter() - started < 1 + LATE_S


async def test_a_trainer_side_failure_names_the_rank_and_the_next_push_reconnects() -> None:
    """The trainer's weights raise mid-iteration: the push fails within the timeout naming trainer rank 0
    (the servers blocked on the broadcast are given up on), and the next push works on a new group."""
    client = ThreadClient(1)
    fail = [True]

    def weights() -> Any:
        for index, item in enumerate(mixed_weights()):
            if fail[0] and index == 3:
                raise RuntimeError("the gather of layer 3 failed")
            yield item

    transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", bucket_size_mb=1e-5, timeout_s=60))
    source = StaticWeights(weights)
    try:
        started = time.perf_counter()
        with pytest.raises(
            WeightTransferError, match=r"trainer rank 0: .*RuntimeError: the gather of layer 3"
        ):
            await transfer.push(client, source, policy_version=1)
        assert time.perf_counter() - started < 30  # within, not at, the 60 s timeout
        fail[0] = False
        client.close()
        await transfer.push(client, source, policy_version=2)
        assert_same_weights(mixed_weights(), client.received[0])
    finally:
        transfer.close()
        client.close()


def test_transport_specs_are_picklable() -> None:
    """Transport halves are shipped by value to a trainer process or rank."""
    import pickle

    from rollflow.weights import TransportCall
    from rollflow.weights.broadcast import BroadcastTransport
    from rollflow.weights.checkpoint import CheckpointTransport
    from rollflow.weights.cuda_ipc import CudaIpcTransport
    from rollflow.weights.vllm_nccl import VllmNcclTransport

    transports = [
        create_strategy("broadcast", backend="gloo").create_sender(2).transport,
        create_strategy("checkpoint").create_sender(2).transport,
        create_strategy("cuda_ipc").create_sender(2).transport,
        create_strategy("broadcast", engine="vllm").create_sender(2).transport,
    ]
    kinds = (BroadcastTransport, CheckpointTransport, CudaIpcTransport, VllmNcclTransport)
    for transport, kind in zip(transports, kinds, strict=True):
        call = TransportCall(transport, "open", {"release": ["x"]})
        copy = pickle.loads(pickle.dumps(call))
        assert isinstance(copy.transport, kind) and copy == call


def test_cuda_ipc_buckets_are_cut_as_the_receivers_plan_them() -> None:
    """The trainer cuts buckets while it iterates; receivers cut them from the metadata: the same rule."""
    from rollflow.weights.trainer.cuda_ipc import buckets as _buckets

    weights = mixed_weights()
    for bucket_size_bytes in (1, 40, 100, 10**9):
        streamed = [[name for name, _ in bucket] for bucket in _buckets(iter(weights), bucket_size_bytes)]
        planned = [
            [weights[i][0] for i in bucket] for bucket in plan_buckets(specs_of(weights), bucket_size_bytes)
        ]
        assert streamed == planned, bucket_size_bytes


# ---------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("transport", ["file", "http"])
async def test_checkpoint_round_trip(tmp_path: Path, transport: str) -> None:
    checkpoint_dir = tmp_path / "ckpt" if transport == "file" else None
    client = ThreadClient(2)
    holder = Holder([])
    sender = await connect_sender(
        create_strategy("checkpoint", checkpoint_dir=checkpoint_dir, timeout_s=30), client, holder.source
    )
    try:
        embed = torch.randn(6, 4)
        for version in (1, 2):
            # Tied weights share memory, which safetensors refuses unless the sender copes.
            holder.weights = [*mixed_weights(), ("lm_head.weight", embed), ("model.tied.weight", embed)]
            await sender.push(client, holder.source, policy_version=version)
            for received in client.received:
                assert_same_weights(holder.weights, received)
        if checkpoint_dir is not None:  # only the newest checkpoint is kept
            assert [p.name for p in checkpoint_dir.iterdir()] == ["policy-00000002.safetensors"]
    finally:
        sender.close()
        client.close()


def test_checkpoint_receiver_errors_are_clear(tmp_path: Path) -> None:
    receiver = create_receiver({"backend": "checkpoint", "timeout_s": 2}, 0)
    with pytest.raises(WeightTransferError, match="must be a directory shared"):
        receiver.receive({"path": str(tmp_path / "missing.safetensors")})
    with pytest.raises(InvalidTransferInfoError, match="'path' or 'url'"):
        receiver.receive({"policy_version": 1})
    with pytest.raises(WeightTransferError, match="downloading weights"):
        receiver.receive({"url": "http://127.0.0.1:9/nothing"})


# ---------------------------------------------------------------- local and cuda_ipc


@pytest.mark.local_only(reason="the in-process weight strategy")
async def test_local_strategy_loads_weights_into_in_process_engines(tiny_model_dir: Path) -> None:
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm

    client = LocalInferenceClient(
        [TorchEngine(load_causal_lm(tiny_model_dir), max_batch_size=2, max_model_len=64)]
    )
    state = client.engines[0].model.state_dict()
    # lm_head.weight is tied to the embeddings: leave it out, or it would overwrite them.
    new_weights = {name: torch.randn_like(t) for name, t in state.items() if name != "lm_head.weight"}
    source = StaticWeights(new_weights.items)
    sender = await connect_sender(create_strategy("local"), client.control, source)
    await sender.push(client.control, source, policy_version=3)
    assert all(torch.equal(state[name], tensor) for name, tensor in new_weights.items())
    await client.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_ipc_round_trip_to_receiver_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    client = ProcessClient(1, tmp_path)
    await client.start()
    weights = [(name, tensor.cuda()) for name, tensor in mixed_weights()]
    source = StaticWeights(lambda: weights)
    sender = await connect_sender(
        create_strategy("cuda_ipc", bucket_size_mb=100 / 2**20, timeout_s=60), client, source
    )
    try:
        await sender.push(client, source, policy_version=1)
        assert client.updates > 1  # one /update_weights per bucket
        received = []
        for update in range(1, client.updates + 1):
            client.updates = update
            received += list(load_file(client.received_path(0), device="cuda").items())
        assert_same_weights(weights, received)
    finally:
        sender.close()
        await client.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_two_gpus
async def test_broadcast_nccl_round_trip_to_receiver_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    client = ProcessClient(1, tmp_path)
    await client.start()
    weights = [(name, tensor.cuda()) for name, tensor in mixed_weights() if tensor.dtype != torch.bool]
    source = StaticWeights(lambda: weights)
    sender = await connect_sender(
        create_strategy("broadcast", backend="nccl", bucket_size_mb=100 / 2**20, timeout_s=60), client, source
    )
    try:
        await sender.push(client, source, policy_version=1)
        assert_same_weights(weights, list(load_file(client.received_path(0), device="cuda").items()))
    finally:
        sender.close()
        await client.close()


@pytest.mark.slow
async def test_the_barrier_timeout_names_the_servers_and_rank_still_pending() -> None:
    from rollflow.orchestrator.barrier import WeightBarrier, WeightSyncTimeoutError

    class PausableClient(ThreadClient):
        """A data-plane client whose control plane is itself."""

        @property
        def control(self) -> PausableClient:
            return self

        async def pause(self, mode: str) -> None:
            pass

        async def resume(self) -> None:
            pass

    client = PausableClient(1, hang_update=True)
    timeout_s = 1.5
    barrier = WeightBarrier(
        client,
        WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=timeout_s)),
        timeout_s=timeout_s,
    )
    started = time.perf_counter()
    try:
        with pytest.raises(
            WeightSyncTimeoutError,
            match=r"the trainer's push took longer .*still waiting on .*fake://server0",
        ):
            await barrier.update(StaticWeights(lambda: [("w", torch.ones(1_000_000))]), 1, "keep")
        assert time.perf_counter() - started < timeout_s + LATE_S
    finally:
        barrier.close()
        client.close()


@pytest.mark.slow
async def test_when_the_servers_blame_the_trainer_its_own_later_error_is_reported() -> None:
    """A worker group reports a rank's failure only after stopping the ranks it left stuck (seconds after the
    servers saw their peer go): the trainer's error, which names the rank, still wins over the servers' 502;
    a trainer that never reports leaves the servers' error, at the timeout."""
    import time

    import anyio

    from rollflow.inference.remote import ControlPlaneError, RemoteInferenceError
    from rollflow.weights.base import SERVER_ERROR_GRACE_S
    from rollflow.weights.rounds import run_with_servers

    url = "http://127.0.0.1:1"
    peer_gone = ControlPlaneError(
        "update_weights",
        {url: RemoteInferenceError("weight transfer failed: peer closed", url=url, status=502)},
    )

    async def servers_blame_the_trainer() -> None:
        raise peer_gone

    async def trainer_fails_later() -> None:
        await anyio.sleep(SERVER_ERROR_GRACE_S + 0.5)
        raise WeightTransferError("trainer rank 1: weight transport push failed: RuntimeError: boom")

    with pytest.raises(WeightTransferError, match="trainer rank 1: .*boom") as raised:
        await run_with_servers("pushing", trainer_fails_later, servers_blame_the_trainer, timeout_s=30)
    assert any("the servers report" in note for note in raised.value.__notes__)

    async def trainer_never_reports() -> None:
        await anyio.sleep(60)

    started = time.perf_counter()
    with pytest.raises(ControlPlaneError) as raised:
        await run_with_servers("pushing", trainer_never_reports, servers_blame_the_trainer, timeout_s=1.0)
    assert time.perf_counter() - started < 1 + LATE_S  # at the timeout, not after the trainer's 60 s
    assert any("did not finish within 1 s" in note for note in raised.value.__notes__)


async def test_an_unset_broadcast_backend_is_picked_on_trainer_rank_0() -> None:
    """``backend=None`` stays unresolved in the orchestrator; trainer rank 0 picks its default (gloo without a
    GPU) when the transport opens, and the servers are told it."""
    strategy = create_strategy("broadcast", timeout_s=30)
    assert strategy.backend is None
    client = ThreadClient(1)
    holder = Holder(mixed_weights())
    transfer = WeightTransfer(strategy)
    try:
        await transfer.push(client, holder.source, policy_version=1)
        assert transfer.sender is not None
        assert transfer.sender.init_info["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
        assert_same_weights(mixed_weights(), client.received[0])
    finally:
        transfer.close()
        client.close()
