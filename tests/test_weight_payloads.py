"""Weight payloads as Structs: the exact JSON each kind of server gets, and what the engine server decodes."""

from __future__ import annotations

import msgspec
import pytest

from rollflow.errors import InvalidTransferInfoError
from rollflow.weights.payloads import (
    ROLLFLOW_ENGINE_GLOO_INIT_KEYS,
    VLLM_NCCL_INIT_KEYS,
    CheckpointInit,
    CheckpointUpdate,
    GlooInit,
    IpcInit,
    IpcUpdate,
    NcclInit,
    TensorsUpdate,
    decode_init_info,
    decode_update_info,
)

RENDEZVOUS = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}
SPECS = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]]}


def gloo() -> str:
    return "gloo"


def test_a_broadcast_init_for_rollflow_servers_has_todays_keys():
    wire = NcclInit(**RENDEZVOUS, group_name="rollflow-weights-ab", timeout_s=30.0).encode_for("torch")
    assert wire == {
        "backend": "nccl",
        **RENDEZVOUS,
        "rank_offset": 1,
        "packed": True,
        "packed_buffer_size_bytes": 256 * 2**20,
        "group_name": "rollflow-weights-ab",
        "timeout_s": 30.0,
    }
    assert GlooInit(**RENDEZVOUS).encode_for("torch")["backend"] == "gloo"


def test_vllm_servers_get_vllms_keys_only():
    wire = NcclInit(**RENDEZVOUS, packed_num_buffers=3).encode_for("vllm")
    assert list(wire) == list(VLLM_NCCL_INIT_KEYS) and wire["packed_num_buffers"] == 3
    assert IpcInit(timeout_s=9.0).encode_for("vllm") == {"packed": True}
    assert TensorsUpdate(**SPECS, policy_version=4).encode_for("vllm") == SPECS
    # A gloo broadcast reaches vLLM through rollflow's plugin engine (rollflow.vllm_plugin): its keys only.
    gloo = GlooInit(**RENDEZVOUS).encode_for("vllm")
    assert set(gloo) <= set(ROLLFLOW_ENGINE_GLOO_INIT_KEYS) and gloo["backend"] == "gloo"
    # vLLM takes checkpoints through rollflow's plugin engine (rollflow.vllm_plugin): its own keys only.
    assert CheckpointInit(timeout_s=4.0).encode_for("vllm") == {"timeout_s": 4.0}
    assert CheckpointUpdate(path="/w/p.safetensors", policy_version=3).encode_for("vllm") == {
        "path": "/w/p.safetensors",
        "policy_version": 3,
    }


def test_updates_repeat_the_policy_version_for_rollflow_servers_only():
    assert TensorsUpdate(**SPECS, policy_version=4).encode_for("torch") == {**SPECS, "policy_version": 4}
    assert TensorsUpdate(**SPECS).encode_for("torch") == SPECS
    assert CheckpointUpdate(url="http://h/x", policy_version=2).encode_for("torch") == {
        "url": "http://h/x",
        "policy_version": 2,
    }
    ipc = IpcUpdate(**SPECS, tensor_sizes=[24], ipc_handles_pickled="aGk=", policy_version=1)
    assert ipc.encode_for("vllm") == {**SPECS, "tensor_sizes": [24], "ipc_handles_pickled": "aGk="}
    assert ipc.encode_for("torch") == {**ipc.encode_for("vllm"), "policy_version": 1}


@pytest.mark.parametrize(
    "payload",
    [
        GlooInit(**RENDEZVOUS, rank_offset=2),
        NcclInit(**RENDEZVOUS),
        CheckpointInit(timeout_s=4.0),
        IpcInit(packed_buffer_size_bytes=1024),
    ],
)
def test_the_server_decodes_what_the_sender_encodes(payload):
    wire = msgspec.json.decode(msgspec.json.encode(payload.encode_for("torch")))
    assert decode_init_info(wire, gloo) == payload


def test_the_server_reads_vllms_shapes():
    vllm = NcclInit(**RENDEZVOUS).encode_for("vllm")
    decoded = decode_init_info(vllm, gloo)  # no backend: the server's default
    assert isinstance(decoded, GlooInit) and decoded.master_port == 29500 and decoded.timeout_s == 300.0
    assert decode_init_info({"packed": True}, gloo) == IpcInit()
    update = decode_update_info(SPECS, TensorsUpdate)
    assert update.policy_version is None and update.shapes == [[2, 3]]


def test_bad_payloads_name_the_problem():
    with pytest.raises(InvalidTransferInfoError, match="JSON object, got list"):
        decode_init_info(["gloo"], gloo)
    with pytest.raises(InvalidTransferInfoError, match="init_info.backend is 'pigeon'; expected one of"):
        decode_init_info({"backend": "pigeon"}, gloo)
    with pytest.raises(
        InvalidTransferInfoError, match="broadcast init_info is missing or has a bad field.*master"
    ):
        decode_init_info({"backend": "nccl", "world_size": 2}, gloo)
    with pytest.raises(
        InvalidTransferInfoError, match=r"bad field: Expected `int`, got `str` - at `\$.master_port`"
    ):
        decode_init_info({**RENDEZVOUS, "backend": "gloo", "master_port": "x"}, gloo)
    with pytest.raises(InvalidTransferInfoError, match=r"broadcast update_info .* at `\$.names`"):
        decode_update_info({"names": None}, TensorsUpdate)
    with pytest.raises(InvalidTransferInfoError, match="update_info must be a JSON object"):
        decode_update_info("path", CheckpointUpdate)
