"""The rollflow side of real-vLLM support, without a vLLM: how a vLLM server is started
(``inference.vllm_command``), which weight-transfer engine it gets, the checkpoint strategy's payloads for
rollflow's plugin engine, and the proof of delivery after each push (``/weight_info``). The same paths
against a real vLLM: ``tests/test_vllm_server.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from rollflow.config import ServerSpec, build_config
from rollflow.errors import ConfigError, MissingExtraError, WeightTransferError
from rollflow.inference.setup import server_options
from rollflow.launch.server_group import ServerGroup, build_vllm_server_command
from rollflow.vllm_plugin import ENGINE_BACKEND
from rollflow.weights import StaticWeights, WeightTransfer, create_strategy

from .helpers.weights import fake_world

MODULE = ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
# The checkpoint transport's fields of the plugin engine's dataclasses (rollflow/vllm_plugin/engine.py).
PLUGIN_INIT_KEYS = {"timeout_s"}
PLUGIN_UPDATE_KEYS = {"path", "url", "policy_version"}


def _http_vllm(**inference: Any) -> dict[str, Any]:
    return {"inference": {"mode": "http", "engine": "vllm", **inference}}


# ---------------------------------------------------------------- inference.vllm_command


def test_vllm_command_defaults_to_vllm_serve_and_takes_another_environment() -> None:
    assert build_config(_http_vllm()).inference.vllm_command == ["vllm", "serve"]
    config = build_config(_http_vllm(vllm_command=MODULE))
    spec = ServerSpec.from_inference(config.inference)
    assert spec.vllm_command == tuple(MODULE)
    argv, _ = build_vllm_server_command("/models/tiny", port=8000, spec=spec)
    # The module entry point takes the model as --model; `vllm serve` as its first argument.
    assert argv[:5] == [*MODULE, "--model", "/models/tiny"]
    default, _ = build_vllm_server_command("/models/tiny", port=8000)
    assert default[:3] == ["vllm", "serve", "/models/tiny"]
    assert "--model" not in default
    # Not a flag: the spec's flags do not include it.
    assert not any(part in spec.argv("vllm") for part in MODULE)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("vllm serve", "invalid value for .inference.vllm_command.: Expected `array`, got `str`"),
        ([], "inference.vllm_command = \\[\\] must name a program"),
        (["vllm", ""], "inference.vllm_command = \\['vllm', ''\\] must name a program"),
    ],
)
def test_a_bad_vllm_command_is_a_config_error_naming_the_key(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(_http_vllm(vllm_command=value))


async def test_a_vllm_command_that_is_not_there_names_the_key(tmp_path) -> None:
    spec = ServerSpec(
        vllm_command=(str(tmp_path / "no-such-python"), "-m", "vllm.entrypoints.openai.api_server")
    )
    group = ServerGroup("m", 1, tmp_path, engine="vllm", server_options={"spec": spec})
    with pytest.raises(MissingExtraError, match="point inference.vllm_command at a vLLM environment"):
        await group.start()


# ---------------------------------------------------------------- which engine the vLLM servers get


def test_vllm_servers_fed_by_checkpoints_get_rollflow_s_plugin_engine() -> None:
    config = build_config({**_http_vllm(), "weight_sync": {"strategy": "checkpoint"}})
    options = server_options(config, api_key=None)
    assert options["weight_transfer_backend"] == ENGINE_BACKEND
    argv, _ = build_vllm_server_command("m", port=1, **options)
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "rollflow"}
    # So do servers fed by a gloo broadcast (the same engine's other transport).
    gloo = build_config({**_http_vllm(), "weight_sync": {"strategy": "broadcast", "backend": "gloo"}})
    assert server_options(gloo, api_key=None)["weight_transfer_backend"] == ENGINE_BACKEND
    # Other strategies keep vLLM's own engines; rollflow's servers take no such option.
    assert "weight_transfer_backend" not in server_options(build_config(_http_vllm()), api_key=None)
    torch_config = build_config({"inference": {"mode": "http"}, "weight_sync": {"strategy": "checkpoint"}})
    assert "weight_transfer_backend" not in server_options(torch_config, api_key=None)


def test_the_checkpoint_strategy_takes_the_engine_from_the_config() -> None:
    config = build_config({**_http_vllm(), "weight_sync": {"strategy": "checkpoint"}})
    options = config.weight_sync.strategy_options("checkpoint", config.inference.engine)
    assert create_strategy("checkpoint", **options).engine == "vllm"
    with pytest.raises(ValueError, match="engine must be one of 'torch', 'vllm'"):
        create_strategy("checkpoint", engine="sglang")


# ---------------------------------------------------------------- payloads and proof of delivery


class FakeVllmServers:
    """vLLM's RL control plane as the plugin engine answers it: payloads are kept, files read, and each
    server labels its weights with ``/finish_weight_update``'s version, except the ``stuck`` ones; checksums
    are of the loaded tensors (in ``served_dtype``), except the ``corrupt`` server's ``model.norm.weight``."""

    def __init__(
        self,
        num_servers: int,
        stuck: tuple[int, ...] = (),
        corrupt: int | None = None,
        served_dtype: torch.dtype = torch.float32,
    ):
        self.server_urls = [f"http://vllm{i}:8000" for i in range(num_servers)]
        self.stuck = {self.server_urls[i] for i in stuck}
        self.init_infos: list[Any] = []
        self.update_infos: list[dict[str, Any]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.versions: dict[str, str | None] = dict.fromkeys(self.server_urls)
        self.corrupt = None if corrupt is None else self.server_urls[corrupt]
        self.served_dtype = served_dtype

    async def world_size(self):
        return fake_world(len(self.server_urls), self.server_urls)

    async def init_weight_transfer(self, init_infos):
        self.init_infos.extend(init_infos)

    async def start_weight_update(self):
        pass

    async def update_weights(self, update_info):
        self.update_infos.append(dict(update_info))
        if "path" in update_info:
            self.loaded = load_file(update_info["path"])
        else:
            import urllib.request

            with urllib.request.urlopen(update_info["url"], timeout=10) as response:
                self.loaded = load_safetensors(response.read())

    async def finish_weight_update(self, policy_version=None):
        for url in self.server_urls:
            if url not in self.stuck:
                self.versions[url] = str(policy_version)

    async def weight_versions(self):
        return dict(self.versions)

    async def weight_checksums(self):
        import hashlib

        def digest(name: str, tensor: torch.Tensor, url: str) -> str:
            tensor = tensor.to(self.served_dtype)
            if url == self.corrupt and name == "model.norm.weight":
                tensor = tensor + 1
            return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

        return {url: {n: {digest(n, t, url)} for n, t in self.loaded.items()} for url in self.server_urls}


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", torch.arange(12.0).reshape(3, 4)),
        ("model.layers.0.input_layernorm.weight", torch.linspace(0.5, 1.5, 4)),
        ("model.norm.weight", torch.linspace(0.9, 1.1, 4)),
    ]


@pytest.mark.parametrize("transport", ["shared_dir", "http"])
async def test_a_push_to_vllm_sends_only_the_plugin_engine_s_keys(tmp_path, transport: str) -> None:
    servers = FakeVllmServers(2)
    options = {"checkpoint_dir": str(tmp_path)} if transport == "shared_dir" else {}
    transfer = WeightTransfer(create_strategy("checkpoint", engine="vllm", timeout_s=30, **options))
    try:
        await transfer.push(servers, StaticWeights(_weights), policy_version=4)
    finally:
        transfer.close()
    assert servers.init_infos == [{"timeout_s": 30}]
    assert set(servers.init_infos[0]) <= PLUGIN_INIT_KEYS
    (update,) = servers.update_infos
    assert set(update) <= PLUGIN_UPDATE_KEYS and update["policy_version"] == 4
    assert ("path" in update) == (transport == "shared_dir")
    assert all(torch.equal(servers.loaded[name], tensor) for name, tensor in _weights())
    assert servers.versions == dict.fromkeys(servers.server_urls, "4")


async def test_a_vllm_server_that_does_not_serve_the_pushed_version_fails_the_push_naming_it() -> None:
    servers = FakeVllmServers(2, stuck=(1,))
    transfer = WeightTransfer(create_strategy("checkpoint", engine="vllm", timeout_s=30))
    with pytest.raises(WeightTransferError, match=r"http://vllm1:8000 serves weight_version None") as caught:
        await transfer.push(servers, StaticWeights(_weights), policy_version=2)
    assert "http://vllm0:8000" not in str(caught.value)
    assert transfer.sender is None  # the next push reconnects
    transfer.close()


@pytest.mark.parametrize("served_dtype", [torch.float32, torch.bfloat16])
async def test_digests_of_named_tensors_prove_delivery_in_the_server_s_dtype(served_dtype) -> None:
    servers = FakeVllmServers(2, served_dtype=served_dtype)
    transfer = WeightTransfer(create_strategy("checkpoint", engine="vllm", timeout_s=30))
    try:
        await transfer.push(servers, StaticWeights(_weights), policy_version=1)
    finally:
        transfer.close()
    # The digests stay on the trainer's side: the plugin engine refuses unknown update_info keys.
    assert set(servers.update_infos[0]) <= PLUGIN_UPDATE_KEYS


async def test_a_vllm_server_holding_another_tensor_fails_the_push_naming_it_and_the_tensor() -> None:
    servers = FakeVllmServers(2, corrupt=0)
    transfer = WeightTransfer(create_strategy("checkpoint", engine="vllm", timeout_s=30))
    with pytest.raises(
        WeightTransferError, match=r"http://vllm0:8000 holds model.norm.weight with another digest"
    ):
        await transfer.push(servers, StaticWeights(_weights), policy_version=3)
    transfer.close()


def test_digests_name_a_few_one_dimensional_tensors_spread_over_the_model() -> None:
    from rollflow.weights.delivery import tensor_digests

    named = [(f"model.layers.{i}.input_layernorm.weight", torch.full((4,), float(i))) for i in range(10)]
    named.append(("model.embed_tokens.weight", torch.ones(3, 4)))
    digests = tensor_digests(named, limit=3)
    assert sorted(digests) == [named[i][0] for i in (0, 4, 9)]  # first, middle, last (in name order)
    assert all(len(per_dtype) == 3 for per_dtype in digests.values())  # float32, bfloat16, float16


def test_the_plugin_never_stops_a_vllm_from_starting(caplog) -> None:
    """vLLM calls every installed plugin unguarded: where vLLM (or its weight-transfer registry) is missing,
    ``register`` warns and returns."""
    import importlib.util

    from rollflow.vllm_plugin import register

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm_server.py covers registering into it")
    register()
    assert "cannot register 'rollflow'" in caplog.text
