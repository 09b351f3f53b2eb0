"""Trainer set-up: device and dtype (bf16 compute over float32 master weights), gradient checkpointing,
the learning-rate schedule and its checkpointing, and the bad-input errors of these keys."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig, load_config
from rollflow.errors import ConfigError
from rollflow.models.loading import check_devices, resolve_device, resolve_dtype

from .helpers.training import PackingTrainer, make_batch

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def make_trainer(model, total_steps: int | None = None, **config):
    return PackingTrainer(
        model, TrainerConfig(**config), pad_token_id=model.config.pad_token_id, total_steps=total_steps
    )


# ---------------------------------------------------------------- config keys and bad input


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.device=tpu", "trainer.device"),
        ("trainer.dtype=float16", "trainer.dtype"),
        ("trainer.gradient_checkpointing=3", "trainer.gradient_checkpointing"),
        ("trainer.lr_schedule=step", "trainer.lr_schedule"),
        ("trainer.warmup_steps=-1", "trainer.warmup_steps"),
        ("trainer.logprob_chunk_tokens=-1", "trainer.logprob_chunk_tokens"),
        ("inference.device=gpu", "inference.device"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_defaults_resolve_to_float32_on_the_cpu():
    config = load_config()
    device = resolve_device(config.trainer.device, "trainer.device")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        assert resolve_dtype(config.trainer.dtype, device, "trainer.dtype") == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), "trainer.dtype") == torch.bfloat16
    check_devices(config)


@NO_CUDA
@pytest.mark.parametrize("key", ["trainer.device", "inference.device"])
def test_cuda_without_cuda_is_a_config_error_naming_the_key(key):
    config = load_config(overrides=[f"{key}=cuda"])
    with pytest.raises(ConfigError, match=re.escape(f"{key} = 'cuda' but torch sees no CUDA")):
        check_devices(config)


def test_an_engine_device_is_not_checked_for_servers_rollflow_does_not_start():
    config = load_config(
        overrides=[
            "inference.mode=http",
            "inference.device=cuda",
            'inference.external_server_urls=["http://127.0.0.1:1"]',
        ]
    )
    check_devices(config)  # the external server's own machine decides


@pytest.mark.slow
@NO_CUDA
def test_rollflow_run_with_a_cuda_trainer_fails_before_anything_starts(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "rollflow", "run", "examples/quickstart.toml", "--no-progress"),
            *("--set", f"output_dir={tmp_path}", "--set", "trainer.device=cuda"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode != 0
    assert "trainer.device = 'cuda' but torch sees no CUDA" in result.stderr
    assert not (tmp_path / "quickstart" / "logs").exists()  # no server, router or trainer process started


@pytest.mark.slow
@NO_CUDA
def test_rollflow_serve_on_cuda_without_cuda_exits_with_a_config_error():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow",
            "serve",
            "--model",
            "rollflow:tiny",
            "--port",
            "0",
            "--device",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--device = 'cuda' but torch sees no CUDA" in result.stderr


# ---------------------------------------------------------------- precision and gradient checkpointing


def test_bf16_compute_keeps_float32_master_weights_and_tracks_the_float32_step(base_model):
    batch = make_batch(base_model, seed=5)
    results = {}
    for dtype in ("float32", "bfloat16"):
        trainer = make_trainer(copy.deepcopy(base_model), dtype=dtype, lr=1e-3)
        results[dtype] = trainer.train_step(batch, policy_version=0)
        assert results[dtype].updated
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert all(p.grad.dtype == torch.float32 for p in trainer.model.parameters())
        moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)
    full, half = results["float32"].metrics, results["bfloat16"].metrics
    # bf16 matmuls (8 mantissa bits) perturb logprobs by ~1e-2: visible in the mismatch, small in the loss.
    assert full["logprob_mismatch"] < 1e-5 < half["logprob_mismatch"] < 0.1
    assert half["grad_norm"] == pytest.approx(full["grad_norm"], rel=0.05)
    assert half["entropy"] == pytest.approx(full["entropy"], rel=0.01)


def _count_layer_forwards(model) -> list[int]:
    """Counts runs of every decoder layer's MLP (a wrapper, not a hook: the recompute runs no module hooks)."""
    calls = [0]

    def counted(forward):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)

        return wrapper

    for layer in model.model.layers:
        layer.mlp.forward = counted(layer.mlp.forward)
    return calls


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_step(base_model):
    batch = make_batch(base_model, seed=6)
    layers = base_model.config.num_hidden_layers
    outcome = {}
    for checkpointing in (False, True):
        trainer = make_trainer(
            copy.deepcopy(base_model), gradient_checkpointing=checkpointing, micro_batch_size=64
        )
        calls = _count_layer_forwards(trainer.model)
        result = trainer.train_step(batch, policy_version=0)
        # One micro-batch: each layer runs once forward, and once more in the backward when checkpointed.
        assert calls[0] == layers * (2 if checkpointing else 1)
        outcome[checkpointing] = (result.metrics, trainer.model.state_dict())
    (plain, plain_state), (checkpointed, checkpointed_state) = outcome[False], outcome[True]
    assert checkpointed["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    for name, tensor in plain_state.items():
        torch.testing.assert_close(checkpointed_state[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_bf16_with_gradient_checkpointing_steps(base_model):
    trainer = make_trainer(copy.deepcopy(base_model), dtype="bfloat16", gradient_checkpointing=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train_step(make_batch(base_model, seed=7), policy_version=0)
    assert result.updated and math.isfinite(result.metrics["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


# ---------------------------------------------------------------- learning-rate schedule


def small_batch(model, seed: int):
    return make_batch(model, seed=seed, groups=1, group_size=2)


def _expected_lrs(name: str, lr: float, warmup: int, total: int) -> list[float]:
    """The schedule straight from transformers (the oracle of rollflow's own), on a throw-away optimizer."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    ("schedule", "hf_name"),
    [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")],
)
def test_lr_follows_the_schedule_and_is_logged(base_model, schedule, hf_name):
    total, warmup = 5, 2
    trainer = make_trainer(
        copy.deepcopy(base_model), total_steps=total, lr=1e-3, lr_schedule=schedule, warmup_steps=warmup
    )
    logged = [
        trainer.train_step(small_batch(base_model, step), policy_version=0).metrics["lr"]
        for step in range(total)
    ]
    assert logged == pytest.approx(_expected_lrs(hf_name, 1e-3, warmup, total), abs=1e-12)
    assert logged[0] == 0.0 and max(logged) == pytest.approx(1e-3)
    if schedule != "constant":
        assert logged[-1] < logged[2]


def test_a_resumed_trainer_continues_the_schedule(base_model, tmp_path):
    options = dict(total_steps=6, lr=1e-3, lr_schedule="cosine", warmup_steps=2)
    batches = [small_batch(base_model, step) for step in range(6)]
    expected = _expected_lrs("cosine", 1e-3, 2, 6)

    first = make_trainer(copy.deepcopy(base_model), **options)
    lrs = [first.train_step(b, policy_version=0).metrics["lr"] for b in batches[:3]]
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = make_trainer(copy.deepcopy(base_model), **options)
    resumed.load_checkpoint(tmp_path / "ckpt")
    lrs += [resumed.train_step(b, policy_version=0).metrics["lr"] for b in batches[3:]]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[3] > lrs[0] == 0.0  # a schedule restarted at step 0 would begin the resumed part at 0 again

    in_memory = make_trainer(copy.deepcopy(base_model), **options)
    in_memory.load_state_dict(copy.deepcopy(first.state_dict()))
    assert in_memory.train_step(batches[3], policy_version=0).metrics["lr"] == pytest.approx(expected[3])


def test_a_decaying_schedule_needs_the_run_length(base_model):
    with pytest.raises(ValueError, match="total_steps"):
        make_trainer(copy.deepcopy(base_model), lr_schedule="linear")


def test_the_resolved_config_records_the_new_keys():
    config = load_config(overrides=["trainer.lr_schedule=cosine", "trainer.warmup_steps=3"])
    trainer = json.loads(json.dumps({"trainer": {"lr_schedule": config.trainer.lr_schedule}}))
    assert trainer == {"trainer": {"lr_schedule": "cosine"}} and config.trainer.warmup_steps == 3


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("which", ["tiny", "tiny_moe"])
def test_an_empty_model_filled_from_a_state_dict_equals_the_loaded_one(which, request):
    from rollflow.models.loading import empty_causal_lm, load_causal_lm, materialize

    model_dir = request.getfixturevalue(f"{which}_model_dir")
    loaded = load_causal_lm(model_dir)
    empty = empty_causal_lm(model_dir)
    assert {p.device.type for p in empty.parameters()} == {"meta"}  # nothing read, nothing allocated
    materialize(empty, "cpu")
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # tied again after to_empty
    empty.load_state_dict(loaded.state_dict())
    input_ids = torch.randint(
        0, loaded.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(empty(input_ids).logits, loaded(input_ids).logits, rtol=0, atol=0)


def test_servers_rollflow_starts_get_the_engine_device():
    from rollflow.launch.server_group import build_torch_server_command

    command, _ = build_torch_server_command("rollflow:tiny", device="cuda")
    assert command[command.index("--device") + 1] == "cuda"
    assert "--device" not in build_torch_server_command("rollflow:tiny")[0]  # auto: each server decides


def test_bfloat16_on_a_gpu_without_it_is_a_config_error(monkeypatch):
    """resolve_dtype's own decision, on what torch reports for an older GPU (no such GPU is needed)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    cuda = torch.device("cuda")
    with pytest.raises(
        ConfigError, match=r"trainer\.dtype = 'bfloat16' is not supported by Tesla V100.*7\.0"
    ):
        resolve_dtype("bfloat16", cuda, "trainer.dtype")
    assert resolve_dtype("auto", cuda, "trainer.dtype") == torch.float32
