"""``[trainer.lora]`` with ``inference.engine = "vllm"`` (``rollflow.weights.vllm_lora``).

- A config vLLM cannot serve (an ``lm_head`` target, a rank above vLLM's largest, a broadcast strategy) is a
  config error naming the key, raised when the config loads: before any server starts.
- The PEFT directory the transport writes from the wire view (B pre-scaled, ``lora_alpha = r``) is the
  trainer's adapter: ``peft`` loads it onto the base and gives the trainer's logits.
- ``rollflow run`` on a managed vLLM server (``vllm`` + ``slow``: a server start, minutes on a CPU): each step
  loads the new version's adapter, proves it (``/v1/models``), draws the next step with it (sync: mismatch
  < 1e-4 against the trainer with the adapter), and keeps only the versions it should.
"""

from __future__ import annotations

import json
import os

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.weights.vllm_lora import PROBE_PROMPT, PROBE_TOKENS

VLLM = ["inference.mode='http'", "inference.engine='vllm'", "model.path='rollflow:tiny-h32'"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUICKSTART = "examples/quickstart.toml"


def _load(*overrides: str, files=(QUICKSTART,)):
    from .conftest import REPO_ROOT

    return load_config([REPO_ROOT / name for name in files], overrides=[*VLLM, *overrides])


def test_the_lora_quickstart_recipe_on_vllm_is_refused_for_its_lm_head_target() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.lora\.target_modules names 'lm_head'.*inference\.engine"
    ):
        _load(files=(QUICKSTART, "examples/quickstart_lora.toml"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=1024"], r"trainer\.lora\.rank = 1024 is above vLLM's largest --max-lora-rank"),
        (
            ["trainer.lora.rank=8", "weight_sync.strategy='broadcast'"],
            r"weight_sync\.strategy = 'broadcast'.*set weight_sync\.strategy = 'auto' or 'checkpoint'",
        ),
        (
            ["trainer.lora.rank=8", "weight_sync.strategy='checkpoint'", "weight_sync.backend='gloo'"],
            r"weight_sync\.backend = 'gloo'",
        ),
    ],
)
def test_a_lora_config_vllm_cannot_serve_is_a_config_error(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_a_projection_adapter_on_vllm_is_accepted_and_its_servers_get_the_lora_flags() -> None:
    from rollflow.inference.setup import server_options
    from rollflow.launch.server_group import build_vllm_server_command
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    config = _load(
        "trainer.lora.rank=4",
        f"trainer.lora.target_modules={json.dumps(PROJECTIONS)}",
        "orchestrator.mode='fully_async'",
        "orchestrator.max_staleness=2",
    )
    options = server_options(config, None)
    assert (options["max_lora_rank"], options["max_loras"]) == (8, 3)  # vLLM's ranks: 1, 8, 16, …
    argv, env = build_vllm_server_command("m", port=1, **options)
    flags = argv[argv.index("--enable-lora") :]
    assert flags[:5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    sync = _load("trainer.lora.rank=8", f"trainer.lora.target_modules={json.dumps(PROJECTIONS)}")
    assert server_options(sync, None)["max_loras"] == 1
    sender = VllmLoraStrategy(keep_versions=1).create_sender(1)
    assert sender.keep_versions == 1 and sender.directory.is_dir()
    sender.close()  # its temporary directory goes with it
    assert not sender.directory.exists()


def test_the_written_peft_directory_is_the_trainers_adapter(tmp_path) -> None:
    """The transport's directory (B scaled, ``lora_alpha = r``) loaded by ``peft`` onto the base model gives
    the logits of the trainer's adapted model (alpha / rank = 2 here, so a missing scaling shows)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollflow.config import LoraConfig
    from rollflow.models.tiny import ensure_tiny_h32_model
    from rollflow.train.lora import adapter_weights, apply_lora
    from rollflow.weights.vllm_lora import VllmLoraTransport

    base_dir = ensure_tiny_h32_model()
    trained = apply_lora(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(rank=4, alpha=8.0, target_modules=PROJECTIONS),
    )
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    path = VllmLoraTransport(directory=str(tmp_path)).push(0, adapter_weights(trained), lora_name="v1")
    assert path == str(tmp_path / "v1")
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), path
    )
    tokens = torch.tensor([[1, 5, 9, 200, 300, 17, 42, 99]])
    with torch.no_grad():
        expected, served = trained(tokens).logits, loaded(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(tokens).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapter moves the logits
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=0)


def test_a_full_weight_push_into_the_lora_transport_is_refused(tmp_path) -> None:
    import torch

    from rollflow.errors import WeightTransferError
    from rollflow.weights.vllm_lora import VllmLoraTransport

    with pytest.raises(WeightTransferError, match="LoRA adapter only.*'model.norm.weight'"):
        VllmLoraTransport(directory=str(tmp_path)).push(0, [("model.norm.weight", torch.ones(4))], "v1")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("schedule", ["sync", "fully_async"])
def test_a_lora_run_on_a_managed_vllm_server_loads_each_versions_adapter(tmp_path, schedule) -> None:
    """A few steps of the quickstart with an adapter on the projections, on one vLLM server rollflow starts:
    each step's adapter is loaded and proved served (``/v1/models``, and the value probe); sync: every step drawn with the adapter just pushed
    (mismatch < 1e-4); fully async: within the staleness bound, on-policy tokens' mismatch < 1e-4; the
    server's log shows each version loaded and the old ones unloaded."""
    import math

    from .helpers.vllm_runs import check_vllm_steps, managed_vllm, run_quickstart
    from .helpers.vllm_server import PYTHON_ENV, SERVER_ENV, SKIP_REASON

    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(SKIP_REASON)
    steps = int(os.environ.get("ROLLFLOW_VLLM_TRAIN_STEPS", "4"))
    overrides = {
        **managed_vllm(python),
        "orchestrator.mode": f"'{schedule}'",
        "orchestrator.steps": str(steps),
        "orchestrator.prompts_per_step": "4",
        "checkpoint.every": "0",
        "trainer.lr": "3e-3",
        "trainer.lora.rank": "8",
        "trainer.lora.target_modules": json.dumps(PROJECTIONS),
    }
    metrics = run_quickstart(tmp_path, overrides, timeout_s=3500, env=SERVER_ENV)
    # The value probe after every push: the trainer's logprobs of its probe, served with the new adapter.
    assert all(0 <= m["probe_logprob_diff"] < 1e-4 for m in metrics), [
        m.get("probe_logprob_diff") for m in metrics
    ]
    if schedule == "sync":
        check_vllm_steps(metrics, steps)
        kept = 1
    else:
        assert len(metrics) == steps
        assert all(m["delivery_check_time_s"] > 0 for m in metrics)
        assert all(m.get("staleness_max", 0) <= 2 for m in metrics)
        on_policy = [m["logprob_mismatch"] for m in metrics if math.isfinite(m["logprob_mismatch"])]
        assert on_policy and max(on_policy) < 1e-4, on_policy
        kept = 3  # the quickstart's max_staleness + 1
    log = next((tmp_path / "runs" / "quickstart").rglob("server-0.log")).read_text()
    loaded = [v for v in range(1, steps + 1) if f"Loaded new LoRA adapter: name 'rollflow-lora-{v}'" in log]
    removed = [v for v in range(1, steps + 1) if f"Removed LoRA adapter: name 'rollflow-lora-{v}'" in log]
    assert loaded == list(range(1, steps + 1)), log[-3000:]
    assert removed == list(range(1, steps + 1 - kept)), log[-3000:]
    print(f"{schedule}: mismatch {[m['logprob_mismatch'] for m in metrics]}")


class _Servers:
    """A control plane of two servers that take every LoRA call, one of which (``lost``) never serves the
    adapter it accepted (or serves another directory): the silent failure a real vLLM cannot be made to
    show on demand, so a double stands in for the servers here; the transport half is the real one."""

    def __init__(self, lost: str | None, elsewhere: bool = False):
        self.lost, self.elsewhere = lost, elsewhere
        self.adapters: dict[str, dict[str, str]] = {"a": {}, "b": {}}
        self.served: tuple[str | None, int] | None = None
        self.calls: list[tuple[str, str]] = []
        self.probe_offsets: dict[str, float] = {}

    async def world_size(self):
        from rollflow.inference.control import WorldSize

        return WorldSize(total_workers=2, workers_per_server=1, num_servers=2)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        for url in self.adapters:
            if url != self.lost:
                self.adapters[url][name] = path
            elif self.elsewhere:
                self.adapters[url][name] = "/somewhere/else"

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        for adapters in self.adapters.values():
            adapters.pop(name, None)

    async def lora_adapters(self):
        return {url: dict(adapters) for url, adapters in self.adapters.items()}

    def serve_adapter(self, name, policy_version) -> None:
        self.served = (name, policy_version)

    async def sample_logprobs(self, model, prompt, max_tokens, seed=0):
        self.calls.append(("probe", model))
        ids = list(range(max_tokens))
        return {url: (ids, [-1.0 + self.probe_offsets.get(url, 0.0)] * max_tokens) for url in self.adapters}


class _ProbedWeights:
    """The adapter source of ``_adapter_source`` with a trainer's probe: logprob -1 for every token (the
    double's servers answer that, plus their ``probe_offsets[url]``)."""

    def __init__(self):
        self.weights = _adapter_source()
        self.probes: list[tuple[list[int], int]] = []

    def push_weights(self, call):
        return self.weights.push_weights(call)

    def probe_logprobs(self, token_ids, start):
        self.probes.append((list(token_ids), start))
        return [-1.0] * (len(token_ids) - start)


def _adapter_source():
    import torch

    from rollflow.weights import StaticWeights

    return StaticWeights(
        lambda: [
            ("model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(2, 8)),
            ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(8, 2)),
        ]
    )


async def test_versions_are_loaded_served_and_retired_beyond_the_kept_number(tmp_path) -> None:
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    servers = _Servers(lost=None)
    transfer = WeightTransfer(VllmLoraStrategy(checkpoint_dir=tmp_path, keep_versions=2))
    for version in (1, 2, 3):
        await transfer.push(servers, _adapter_source(), version)
        assert servers.served == (f"rollflow-lora-{version}", version)
        assert transfer.delivery_check_s is not None and transfer.delivery_check_s >= 0
    assert sorted(servers.adapters["a"]) == ["rollflow-lora-2", "rollflow-lora-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollflow-lora-2", "rollflow-lora-3"]
    assert ("unload", "rollflow-lora-1") in servers.calls
    transfer.close()
    assert tmp_path.is_dir()  # a configured directory is the user's: only the retired versions go


@pytest.mark.parametrize("elsewhere", [False, True])
async def test_an_adapter_a_server_does_not_serve_stops_the_push(tmp_path, elsewhere) -> None:
    """The push broken on purpose (one server drops the adapter, or serves another directory) is stopped by
    proof of delivery, and the client keeps naming the previous version."""
    from rollflow.errors import WeightTransferError
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    servers = _Servers(lost="b", elsewhere=elsewhere)
    transfer = WeightTransfer(VllmLoraStrategy(checkpoint_dir=tmp_path))
    shown = "serves 'rollflow-lora-1' from '/somewhere/else'" if elsewhere else "lists no 'rollflow-lora-1'"
    with pytest.raises(WeightTransferError, match=f"b {shown}.*does not serve the pushed adapter"):
        await transfer.push(servers, _adapter_source(), 1)
    assert servers.served is None
    transfer.close()


async def test_the_value_probe_passes_servers_that_compute_the_trainers_logprobs(tmp_path) -> None:
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    servers, source = _Servers(lost=None), _ProbedWeights()
    servers.probe_offsets = {"b": 0.01}
    transfer = WeightTransfer(VllmLoraStrategy(checkpoint_dir=tmp_path, probe_tolerance=0.05))
    await transfer.push(servers, source, 1)
    assert transfer.probe_logprob_diff is None  # not probed yet: the engines resume first
    await transfer.verify(servers, source, 1)
    assert ("probe", "rollflow-lora-1") in servers.calls
    assert transfer.probe_logprob_diff == pytest.approx(0.01)
    # Both servers sampled the same tokens: the trainer scored them once, after the probe prompt.
    ((token_ids, start),) = source.probes
    assert token_ids[:start] == list(PROBE_PROMPT) and token_ids[start:] == list(range(PROBE_TOKENS))
    transfer.close()


async def test_a_server_computing_other_logprobs_than_the_trainer_stops_the_run_at_the_probe(
    tmp_path,
) -> None:
    """The push broken on purpose where identity cannot see it: server b serves the pushed directory, but its
    values are off (an adapter written with the wrong scaling, say)."""
    from rollflow.errors import WeightTransferError
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    servers, source = _Servers(lost=None), _ProbedWeights()
    servers.probe_offsets = {"b": -0.5}
    transfer = WeightTransfer(VllmLoraStrategy(checkpoint_dir=tmp_path, probe_tolerance=0.05))
    await transfer.push(servers, source, 1)
    with pytest.raises(WeightTransferError, match=r"differ from the trainer's on average b by 0\.5 "):
        await transfer.verify(servers, source, 1)
    transfer.close()


@pytest.mark.parametrize("case", ["tolerance 0", "no probe from the source"])
async def test_no_value_probe_without_a_tolerance_or_a_trainer_probe(tmp_path, case) -> None:
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    servers = _Servers(lost=None)
    servers.probe_offsets = {"b": 9.0}
    source = _ProbedWeights() if case == "tolerance 0" else _adapter_source()
    tolerance = 0.0 if case == "tolerance 0" else 0.05
    transfer = WeightTransfer(VllmLoraStrategy(checkpoint_dir=tmp_path, probe_tolerance=tolerance))
    await transfer.push(servers, source, 1)
    await transfer.verify(servers, source, 1)
    assert transfer.probe_logprob_diff is None
    assert not any(call[0] == "probe" for call in servers.calls)
    assert not getattr(source, "probes", [])
    transfer.close()


def test_a_negative_probe_tolerance_is_refused() -> None:
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    with pytest.raises(ValueError, match="probe_tolerance must be 0 or more"):
        VllmLoraStrategy(probe_tolerance=-0.1)
    with pytest.raises(ConfigError, match="probe_tolerance"):
        _load("weight_sync.probe_tolerance=-1")
    with pytest.raises(ConfigError, match="probe_tolerance"):
        _load("weight_sync.probe_tolerance='tight'")


# ---------------------------------------------------------------- one real vLLM server with LoRA serving


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """One vLLM server of this module's own with ``--enable-lora`` (rank 8, two adapters at once)."""
    from .helpers.vllm_server import PYTHON_ENV, SKIP_REASON, VllmServer

    if not os.environ.get(PYTHON_ENV):
        pytest.skip(SKIP_REASON)
    server = VllmServer(tmp_path_factory.mktemp("vllm-lora"), lora=(8, 2))
    yield server
    server.close()


def _adapted_model(seed: int):
    """tiny-h32 with a rank-4 adapter on the projections whose B is random (so it moves the logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.config import LoraConfig
    from rollflow.models.tiny import ensure_tiny_h32_model
    from rollflow.train.lora import apply_lora

    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(ensure_tiny_h32_model(), dtype=torch.float32),
        LoraConfig(rank=4, alpha=8.0, target_modules=PROJECTIONS),
    ).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def _mismatch(model, prompt: list[int], output) -> float:
    """Largest |served logprob - the model's| over the sampled tokens (temperature 1)."""
    import torch

    tokens = torch.tensor([prompt + output.token_ids])
    with torch.no_grad():
        logprobs = model(tokens).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    mine = logprobs.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
    return float((mine - torch.tensor(output.logprobs)).abs().max())


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_adapters_pushed_into_a_real_vllm_serve_the_trainers_logprobs_per_version(lora_server) -> None:
    """Two versions pushed into a real vLLM by the vLLM LoRA transfer (proved by ``/v1/models`` each time):
    requests started on each version (the client names its adapter) get that version's logprobs (< 1e-4
    from the adapted model's), the base model is left alone, and a third push retires the first."""
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.messages import GenerateRequest, SamplingParams
    from rollflow.train.lora import adapter_disabled, adapter_weights
    from rollflow.weights import StaticWeights, WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    models = {version: _adapted_model(seed=version) for version in (1, 2, 3)}
    client = RemoteInferenceClient(lora_server.url, [lora_server.url], control_timeout_s=120)
    transfer = WeightTransfer(VllmLoraStrategy(keep_versions=2, timeout_s=120))
    prompt, sampling = [1, 5, 9, 200, 300, 17, 42, 99], SamplingParams(max_tokens=12, seed=3)
    try:
        base = await client.generate(GenerateRequest(prompt, sampling))
        outputs = {}
        for version in (1, 2):
            weights = list(adapter_weights(models[version]))
            await transfer.push(client.control, StaticWeights(lambda w=weights: w), version)
            assert transfer.delivery_check_s is not None
            outputs[version] = await client.generate(GenerateRequest(prompt, sampling))
        client.serve_adapter("rollflow-lora-1", 1)  # a request started on version 1 while 2 is current
        late_first = await client.generate(GenerateRequest(prompt, sampling))
        weights = list(adapter_weights(models[3]))
        await transfer.push(client.control, StaticWeights(lambda: weights), 3)
        served = await client.control.lora_adapters()
        client.serve_adapter(None, 0)
        base_after = await client.generate(GenerateRequest(prompt, sampling))
    finally:
        transfer.close()
        await client.close()
    assert sorted(served[lora_server.url]) == ["rollflow-lora-2", "rollflow-lora-3"]
    figures = {version: _mismatch(models[version], prompt, out) for version, out in outputs.items()}
    figures["late 1"] = _mismatch(models[1], prompt, late_first)
    with adapter_disabled(models[1]):
        figures["base"] = _mismatch(models[1], prompt, base)
        figures["base after"] = _mismatch(models[1], prompt, base_after)
    print(f"served vs adapted-model logprobs: {figures}")
    assert max(figures.values()) < 1e-4, figures
    assert [set(out.policy_versions) for out in outputs.values()] == [{1}, {2}]
    assert set(late_first.policy_versions) == {1}
    # The versions differ: each check above tells them apart.
    assert _mismatch(models[2], prompt, outputs[1]) > 1e-3
    assert _mismatch(models[1], prompt, base_after) > 1e-3


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_a_real_vllm_passes_the_trainers_value_probe_and_fails_an_adapter_written_wrong(
    lora_server,
) -> None:
    """``Trainer.probe_logprobs`` against a real vLLM: the adapter pushed as the trainer holds it matches the
    trainer to < 1e-4; one written with B at four times its scaling (the directory is the pushed one, so the
    identity proof passes) stops at the probe, naming the server."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.config import LoraConfig, TrainerConfig
    from rollflow.errors import WeightTransferError
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.models.tiny import ensure_tiny_h32_model
    from rollflow.train.trainer import Trainer
    from rollflow.weights import WeightTransfer
    from rollflow.weights.vllm_lora import VllmLoraStrategy

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_h32_model(), dtype=torch.float32)
    trainer = Trainer(base, TrainerConfig(lora=LoraConfig(rank=4, alpha=8.0, target_modules=PROJECTIONS)))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(4)
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)

    class MisScaled:
        """The trainer, with a transport that writes B four times as large as the trainer holds it."""

        def push_weights(self, call):
            weights = [(n, t * 4 if "lora_B" in n else t) for n, t in trainer.named_weights()]
            return call(0, iter(weights))

        def probe_logprobs(self, token_ids, start):
            return trainer.probe_logprobs(token_ids, start)

    client = RemoteInferenceClient(lora_server.url, [lora_server.url], control_timeout_s=120)
    transfer = WeightTransfer(VllmLoraStrategy(keep_versions=2, timeout_s=120))
    try:
        # Versions of this test's own: the module's server may still hold the other tests' adapters.
        await transfer.push(client.control, trainer, 11)
        await transfer.verify(client.control, trainer, 11)
        matched = transfer.probe_logprob_diff
        await transfer.push(client.control, MisScaled(), 12)
        with pytest.raises(WeightTransferError, match=f"{lora_server.url} by .*does not compute with the"):
            await transfer.verify(client.control, MisScaled(), 12)
        mis_scaled = transfer.probe_logprob_diff
    finally:
        transfer.close()
        await client.close()
    print(
        f"value probe, mean |served - trainer| logprob: pushed as held {matched}, B written x4 {mis_scaled}"
    )
    assert matched is not None and matched < 1e-4
    assert mis_scaled is not None and mis_scaled > VllmLoraStrategy().probe_tolerance
