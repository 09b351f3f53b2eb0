"""Weight transfer into vLLM servers: exact vLLM 0.33 payload keys, the sender's HTTP sequence (with vLLM's
trainer calls faked on CPU), rollflow receivers accepting vLLM's shapes, and a real vLLM on a GPU machine."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rollflow.config import build_config
from rollflow.errors import ConfigError, MissingExtraError
from rollflow.inference.control import WorldSize
from rollflow.weights import StaticWeights, connect_sender, create_strategy, init_info_for_servers
from rollflow.weights.packing import specs_of
from rollflow.weights.payloads import VLLM_NCCL_INIT_KEYS, VLLM_NCCL_UPDATE_KEYS
from rollflow.weights.server.receiver import create_receiver
from rollflow.weights.trainer.cuda_ipc import ipc_update_info
from rollflow.weights.vllm_nccl import VllmNcclSender, VllmTrainerApi

from .helpers.gpus import needs_two_gpus
from .helpers.weights import fake_world

# vLLM 0.33's dataclasses, field for field (nccl_engine.py / ipc_engine.py); any other key is rejected there.
VLLM_INIT_KEYS = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
}
VLLM_UPDATE_KEYS = {"names", "dtype_names", "shapes"}
VLLM_IPC_UPDATE_KEYS = {"names", "dtype_names", "shapes", "tensor_sizes", "ipc_handles_pickled"}


def weights() -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", torch.randn(5, 4)),
        ("model.norm.weight", torch.ones(4, dtype=torch.bfloat16)),
        ("lm_head.bias", torch.zeros(3, dtype=torch.float16)),
    ]


class RecordingClient:
    """Two fake servers of one worker each; records every control-plane call with its payload."""

    server_urls = ("http://a", "http://b")

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def world_size(self) -> WorldSize:
        return fake_world(2, self.server_urls)

    async def init_weight_transfer(self, init_info: Any) -> None:
        self.calls.append(("init", init_info))

    async def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    async def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        self.calls.append(("finish", policy_version))


def fake_api(sent: list[Any]) -> VllmTrainerApi:
    def join(address: str, port: int, world_size: int) -> Any:
        sent.append(("join", address, port, world_size))
        return "group"

    def send(named: Any, group: Any, buffer_size: int, num_buffers: int) -> None:
        sent.append(("send", [name for name, _ in named], group, buffer_size, num_buffers))

    return VllmTrainerApi(join=join, send=send)


# ---------------------------------------------------------------- payload shapes


def vllm_sender(
    inference_world_size: int, sent: list[Any] | None, bucket_size_bytes: int = 2**20
) -> VllmNcclSender:
    api = None if sent is None else fake_api(sent)
    return VllmNcclSender(inference_world_size, bucket_size_bytes=bucket_size_bytes, timeout_s=10, api=api)


async def test_vllm_broadcast_init_info_has_exactly_vllm_keys() -> None:
    sender = vllm_sender(2, [])
    client = RecordingClient()
    await sender.setup(client, StaticWeights(weights))
    sender.close()
    info = sender.init_info
    assert set(info) == VLLM_INIT_KEYS == set(VLLM_NCCL_INIT_KEYS)
    assert info["rank_offset"] == 1 and info["world_size"] == 3 and info["packed"] is True
    assert info["packed_buffer_size_bytes"] == 2**20 and isinstance(info["master_port"], int)
    # Per-server payloads advance rank_offset and keep the key set.
    payloads = init_info_for_servers(info, num_servers=2, workers_per_server=1)
    assert [p["rank_offset"] for p in payloads] == [1, 2]
    assert all(set(p) == VLLM_INIT_KEYS for p in payloads)
    assert client.calls[0] == ("init", payloads)


def test_vllm_broadcast_rejects_what_vllm_cannot_do() -> None:
    # gloo reaches vLLM through rollflow's plugin engine (tests/test_vllm_broadcast_payloads.py); NCCL otherwise.
    assert create_strategy("broadcast", engine="vllm").backend == "nccl"
    with pytest.raises(ValueError, match="broadcast backend must be 'gloo' or 'nccl', got 'mpi'"):
        create_strategy("broadcast", engine="vllm", backend="mpi")
    with pytest.raises(ValueError, match="engine must be one of 'torch', 'vllm', got 'sglang'"):
        create_strategy("broadcast", engine="sglang")
    with pytest.raises(ValueError, match="cuda_ipc engine must be 'torch' or 'vllm'"):
        create_strategy("cuda_ipc", engine="")


async def test_vllm_sender_sends_exactly_vllm_payloads_and_the_version_at_finish() -> None:
    sent: list[Any] = []
    sender = vllm_sender(2, sent, bucket_size_bytes=2 * 2**20)
    client = RecordingClient()
    source = StaticWeights(weights)
    await sender.setup(client, source)
    await sender.push(client, source, policy_version=7)
    await sender.push(client, source, policy_version=8)
    sender.close()

    kinds = [kind for kind, _ in client.calls]
    assert kinds == ["init", "start", "update", "finish", "start", "update", "finish"]
    init_payloads = client.calls[0][1]
    assert [p["rank_offset"] for p in init_payloads] == [1, 2]
    assert all(set(p) == VLLM_INIT_KEYS for p in init_payloads)
    update_info = client.calls[2][1]
    assert set(update_info) == VLLM_UPDATE_KEYS == set(VLLM_NCCL_UPDATE_KEYS)  # no policy_version, no packed
    assert update_info == {
        "names": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.bias"],
        "dtype_names": ["float32", "bfloat16", "float16"],
        "shapes": [[5, 4], [4], [3]],
    }
    assert [version for kind, version in client.calls if kind == "finish"] == [7, 8]
    # Trainer rank 0 picked the rendezvous port, hosted vLLM's group there, and sent with vLLM's producer.
    assert sent[0] == ("join", "127.0.0.1", sender.init_info["master_port"], 3)
    assert sent[1] == ("send", update_info["names"], "group", 2 * 2**20, 2)


async def test_vllm_sender_world_size_mismatch_and_missing_vllm_are_clear() -> None:
    sender = vllm_sender(1, [])
    source = StaticWeights(weights)
    with pytest.raises(Exception, match="report 2 workers but this sender was made for 1"):
        await sender.setup(RecordingClient(), source)
    with pytest.raises(Exception, match="unusable"):
        await sender.push(RecordingClient(), source, 1)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(MissingExtraError, match=r"pip install 'rollflow\[vllm\]'") as raised:
            await vllm_sender(2, None).setup(RecordingClient(), source)
        assert any("trainer rank 0" in note for note in raised.value.__notes__)


def test_vllm_cuda_ipc_payloads_have_exactly_vllm_keys() -> None:
    strategy = create_strategy("cuda_ipc", engine="vllm")
    assert strategy.create_sender(4).init_info == {"packed": True}
    specs = specs_of(weights())
    info = ipc_update_info(specs, {"GPU-uuid": ("rebuild", ())}, policy_version=None)
    assert set(info) == VLLM_IPC_UPDATE_KEYS
    assert info["tensor_sizes"] == [80, 8, 6]
    # rollflow servers also get the version per update.
    assert ipc_update_info(specs, {}, policy_version=3)["policy_version"] == 3
    assert create_strategy("cuda_ipc").create_sender(1).init_info["backend"] == "ipc"


# ---------------------------------------------------------------- config


def test_config_passes_the_engine_to_the_strategy_and_rejects_what_vllm_cannot_receive() -> None:
    config = build_config({"inference": {"mode": "http", "engine": "vllm"}})
    options = config.weight_sync.strategy_options("broadcast", config.inference.engine)
    assert options["engine"] == "vllm"
    assert create_strategy("broadcast", **options).engine == "vllm"
    assert config.weight_sync.strategy_options("cuda_ipc", "vllm")["engine"] == "vllm"
    # Checkpoint files reach vLLM through rollflow's plugin engine (tests/test_vllm_plumbing.py).
    checkpoint = build_config(
        {"inference": {"mode": "http", "engine": "vllm"}, "weight_sync": {"strategy": "checkpoint"}}
    )
    assert checkpoint.weight_sync.strategy_options("checkpoint", "vllm")["engine"] == "vllm"
    gloo = build_config({"inference": {"mode": "http", "engine": "vllm"}, "weight_sync": {"backend": "gloo"}})
    assert (
        create_strategy("broadcast", **gloo.weight_sync.strategy_options("broadcast", "vllm")).backend
        == "gloo"
    )
    with pytest.raises(ConfigError, match="weight_sync.backend = 'gloo' is the broadcast's backend, but"):
        build_config(
            {
                "inference": {"mode": "http", "engine": "vllm"},
                "weight_sync": {"strategy": "checkpoint", "backend": "gloo"},
            }
        )


# ---------------------------------------------------------------- rollflow receivers accept vLLM's shapes


async def test_rollflow_receiver_accepts_an_init_info_without_backend_or_timeout() -> None:
    """vLLM's payload shape names no backend and no timeout: the receiver defaults them (gloo on CPU)."""
    receivers: list[Any] = []
    received: list[Any] = []

    class OneServer(RecordingClient):
        server_urls = ("http://a",)

        async def world_size(self) -> WorldSize:
            return fake_world(1, self.server_urls)

        async def init_weight_transfer(self, init_info: Any) -> None:
            stripped = {k: v for k, v in init_info[0].items() if k not in ("backend", "timeout_s")}
            receivers.append(await asyncio.to_thread(create_receiver, stripped, 0))

        async def update_weights(self, update_info: Any) -> None:
            received.extend(await asyncio.to_thread(receivers[0].receive, update_info))

    sent = weights()
    source = StaticWeights(lambda: sent)
    sender = await connect_sender(
        create_strategy("broadcast", backend="gloo", timeout_s=30), OneServer(), source
    )
    try:
        await sender.push(OneServer(), source, policy_version=1)
        assert [name for name, _ in received] == [name for name, _ in sent]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, received, strict=True))
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()


@pytest.mark.slow
def test_create_receiver_reads_vllm_ipc_init_info_as_ipc() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the ipc receiver is built; this checks the CPU error names the backend")
    with pytest.raises(Exception, match="'ipc' needs CUDA"):
        create_receiver({"packed": True}, 0)


# ---------------------------------------------------------------- a real vLLM (GPU machines)


@pytest.mark.http_only(reason="vLLM servers receiving a broadcast")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_two_gpus
async def test_vllm_server_receives_a_broadcast_and_labels_the_version(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``vllm serve`` (model: $ROLLFLOW_VLLM_TEST_MODEL, else the tiny model) takes two pushes from the vLLM
    sender; greedy generation with the unchanged weights pushed back is unchanged, and the version is set."""
    from .helpers.vllm_support import require_vllm

    require_vllm()
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.launch.server_group import ServerGroup
    from rollflow.messages import GenerateRequest, SamplingParams
    from rollflow.models.loading import load_causal_lm, resolve_model_path

    model = os.environ.get("ROLLFLOW_VLLM_TEST_MODEL", str(tiny_model_dir))
    options = {"max_model_len": 256, "gpu_memory_utilization": 0.3}
    async with ServerGroup(
        model, 1, tmp_path, engine="vllm", startup_timeout_s=600, server_options=options
    ) as group:
        client = RemoteInferenceClient(group.urls[0], group.urls, control_timeout_s=300)
        request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
        before = await client.generate(request)
        state = load_causal_lm(resolve_model_path(model)).state_dict()
        source = StaticWeights(state.items)
        sender = await connect_sender(
            create_strategy("broadcast", engine="vllm", timeout_s=300), client.control, source
        )
        try:
            for version in (1, 2):
                await client.pause("keep")
                await sender.push(client.control, source, policy_version=version)
                await client.resume()
        finally:
            sender.close()
        answers = await client.weight_info()
        assert [body["weight_version"] for body in answers.values()] == ["2"]
        after = await client.generate(request)
        assert after.token_ids == before.token_ids
        await client.close()
