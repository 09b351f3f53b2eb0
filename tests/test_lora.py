"""``[trainer.lora]``: the config's errors, the adapter trainer (frozen base, the base as KL reference), the
torch engine merging adapter pushes onto its unmerged base, and adapter-only pushes into real ``rollflow
serve`` servers with proof of delivery (a planted stale adapter is caught)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.config import LoraConfig, TrainerConfig, build_config
from rollflow.errors import ConfigError, EngineError
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.lora import adapted_modules, check_lora_targets, resolve_targets
from rollflow.train.trainer import Trainer

from .helpers.training import make_batch

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def lora_trainer(base_model, **config) -> Trainer:
    return Trainer(
        copy.deepcopy(base_model), TrainerConfig(**{"micro_batch_size": 3, "lora": LORA, **config})
    )


def step(trainer: Trainer, base_model, seed: int, policy_version: int = 0):
    batch = pack_for_trainer(make_batch(base_model, seed=seed), trainer.config, trainer.world_size)
    return trainer.train_step(batch, policy_version=policy_version)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            {
                "inference": {"engine": "vllm", "mode": "http"},
                "trainer": {"lora": {"target_modules": ["lm_head"]}},
            },
            "inference.engine = 'vllm'",
        ),
        ({"inference": {"mode": "http"}, "weight_sync": {"strategy": "cuda_ipc"}}, "weight_sync.strategy"),
        ({"trainer": {"placement": "process"}}, "trainer.placement = 'process'"),
        ({"trainer": {"lora": {"dropout": 1.0}}}, "trainer.lora.dropout"),
        ({"trainer": {"lora": {"target_modules": []}}}, "trainer.lora.target_modules"),
    ],
)
def test_lora_with_what_cannot_carry_it_is_a_config_error_naming_the_key(overrides, named):
    data = {"model": {"path": "rollflow:tiny"}, "trainer": {"lora": {}}}
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
        if section == "trainer":
            data[section].setdefault("lora", {})
    with pytest.raises(ConfigError, match="trainer.lora") as error:
        build_config(data)
    assert named in str(error.value)


def test_lora_config_reads_from_toml_keys():
    config = build_config(
        {
            "trainer": {
                "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", r"model\.layers\.1\..*_proj"]}
            }
        }
    )
    assert config.trainer.lora == LoraConfig(
        rank=2, alpha=4.0, target_modules=["q_proj", r"model\.layers\.1\..*_proj"]
    )
    assert build_config({}).trainer.lora is None


def test_target_modules_match_by_name_suffix_or_regular_expression(base_model):
    targets = resolve_targets(
        base_model, LoraConfig(target_modules=["self_attn.q_proj", r"model\.layers\.1\.mlp\..*_proj"])
    )
    assert targets == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]


def test_targets_that_match_nothing_and_a_rank_too_large_fail_before_anything_loads(tiny_model_dir):
    """Checked on the model built on the meta device, as a run does before starting any process."""
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules entry 'qkv_proj' matches no Linear"):
        check_lora_targets(LoraConfig(target_modules=["q_proj", "qkv_proj"]), tiny_model_dir)
    check_lora_targets(LoraConfig(target_modules=["lm_head"]), tiny_model_dir)  # named: the head
    with pytest.raises(ConfigError, match="trainer.lora.target_modules entry 'lm_.*'"):
        check_lora_targets(LoraConfig(target_modules=["lm_.*"]), tiny_model_dir)  # never by a pattern
    with pytest.raises(ConfigError, match=r"trainer.lora.rank = 65 is larger .*self_attn.q_proj \[64, 64\]"):
        check_lora_targets(LoraConfig(rank=65, target_modules=["q_proj"]), tiny_model_dir)
    check_lora_targets(LoraConfig(rank=64, target_modules=["q_proj"]), tiny_model_dir)


async def test_a_run_with_targets_that_match_nothing_fails_in_setup(tmp_path):
    from rollflow.orchestrator import Orchestrator

    config = build_config(
        {
            "model": {"path": "rollflow:tiny"},
            "output_dir": str(tmp_path),
            "trainer": {"lora": {"target_modules": ["nothing_here"]}},
        }
    )
    with pytest.raises(ConfigError, match="trainer.lora.target_modules entry 'nothing_here'"):
        await Orchestrator.start(config)


# ---------------------------------------------------------------- the trainer


def test_only_the_adapter_trains_and_the_base_stays_as_it_was(base_model):
    trainer = lora_trainer(base_model, lr=1e-2)
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert all(p.dtype == torch.float32 for name, p in trainer.model.named_parameters() if name in trainable)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in trainer.model.named_parameters() if name in trainable}
    assert len(adapted_modules(trainer.model)) == 14  # 7 projections x 2 layers
    base = {name.replace(".base_layer", ""): t.clone() for name, t in trainer.model.state_dict().items()}
    assert step(trainer, base_model, seed=1).updated
    for name, tensor in base_model.state_dict().items():
        torch.testing.assert_close(base[name], tensor, rtol=0, atol=0)
    after = {name.replace(".base_layer", ""): t for name, t in trainer.model.state_dict().items()}
    for name, tensor in base_model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=name)
    names = [name for name, _ in trainer.named_weights()]
    assert len(names) == 28 and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in names)


def test_the_kl_reference_is_the_base_without_the_adapter(base_model):
    trainer = lora_trainer(base_model, lr=1e-2, kl_coef=0.1)
    assert trainer.reference_model is None  # no second copy
    first = step(trainer, base_model, seed=1)
    assert first.metrics["kl"] == 0.0  # B starts at 0: the adapted model is the base
    second = step(trainer, base_model, seed=2)
    assert second.metrics["kl"] > 0
    # The full-weight trainer's reference (a frozen copy) agrees on the same weights.
    merged = merged_model(trainer)
    full = Trainer(merged, TrainerConfig(micro_batch_size=3, kl_coef=0.1))
    full.reference_model.load_state_dict(base_model.state_dict())
    batch = pack_for_trainer(make_batch(base_model, seed=3), full.config, 1)
    lora_result = trainer.train_step(copy.deepcopy(batch))
    full_result = full.train_step(batch)
    for name in ("loss", "kl", "entropy"):
        assert lora_result.metrics[name] == pytest.approx(full_result.metrics[name], rel=1e-4, abs=1e-6), name


def test_gradient_checkpointing_and_chunked_logprobs_keep_the_step(base_model):
    results = [
        step(lora_trainer(base_model, **config), base_model, seed=1)
        for config in (
            {"logprob_chunk_tokens": 0},
            {"logprob_chunk_tokens": 5, "gradient_checkpointing": True},
        )
    ]
    for name in ("loss", "grad_norm", "entropy"):
        assert results[0].metrics[name] == pytest.approx(results[1].metrics[name], rel=1e-5), name


def merged_model(trainer: Trainer) -> torch.nn.Module:
    """An independent reference for the engine: peft's own merge of a copy of the trainer's model."""
    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(trainer.model)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    state = {
        name.replace(".base_layer", ""): tensor
        for name, tensor in model.state_dict().items()
        if ".lora_" not in name
    }
    plain = copy.deepcopy(base_plain[0])
    plain.load_state_dict(state)
    return plain


base_plain: list[torch.nn.Module] = []


@pytest.fixture(autouse=True, scope="module")
def _plain(base_model):
    base_plain.append(base_model)
    yield
    base_plain.clear()


# ---------------------------------------------------------------- the engine


async def test_the_engine_serves_each_adapter_version_merged_onto_its_base(base_model):
    from rollflow.inference.engine.engine import TorchEngine

    engine = TorchEngine(copy.deepcopy(base_model), max_batch_size=2, max_model_len=64)
    trainer = lora_trainer(base_model, lr=1e-2)
    try:
        for version in (1, 2, 3):
            assert step(trainer, base_model, seed=version).updated
            await engine.load_weights(trainer.named_weights(), policy_version=version)
            expected = merged_model(trainer).state_dict()
            for name, tensor in engine.model.state_dict().items():
                # Merged onto the unmerged base each time, so three versions in it is still one merge away.
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-6, msg=name)
            assert engine.policy_version == version
        checksums = engine.adapter_checksums()
        assert sorted(checksums) == sorted(name for name, _ in trainer.named_weights())

        # A broken adapter changes nothing.
        wrong = [
            (name, tensor[:, :-1] if name.endswith("lora_A.weight") else tensor)
            for name, tensor in trainer.named_weights()
        ]
        before = {name: t.clone() for name, t in engine.model.state_dict().items()}
        with pytest.raises(EngineError, match="adapter it cannot apply.*do not fit"):
            await engine.load_weights(wrong, policy_version=9)
        half = [(n, t) for n, t in trainer.named_weights() if n.endswith("lora_A.weight")]
        with pytest.raises(EngineError, match="lora_A and lora_B come together"):
            await engine.load_weights(half, policy_version=9)
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        assert engine.policy_version == 3 and engine.adapter_checksums() == checksums

        # Full weights replace the base, and their modules' adapters go with it.
        await engine.load_weights(base_model.state_dict().items(), policy_version=4)
        assert engine.adapter_checksums() == {}
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, base_model.state_dict()[name]), name
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------- checkpoints and export


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes(base_model, tmp_path):
    trainer = lora_trainer(base_model, lr=1e-2)
    assert step(trainer, base_model, seed=1).updated
    trainer.save_checkpoint(tmp_path)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert "adapter/adapter_model.safetensors" in written and "adapter/adapter_config.json" in written
    assert "optimizer.pt" in written and "model.safetensors" not in written
    size = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert size < 400_000  # the adapter and 2 Adam moments of it; the base alone is ~0.9 MB in float32

    resumed = lora_trainer(base_model, lr=1e-2)
    resumed.load_checkpoint(tmp_path)
    expected, actual = step(trainer, base_model, seed=2), step(resumed, base_model, seed=2)
    for name in ("loss", "grad_norm"):
        assert actual.metrics[name] == expected.metrics[name], name
    for (name, tensor), (_, other) in zip(trainer.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(tensor, other), name

    with pytest.raises(Exception, match="trainer.lora"):
        Trainer(copy.deepcopy(base_model), TrainerConfig(lora=LoraConfig(rank=2))).load_checkpoint(tmp_path)


def test_export_writes_a_peft_adapter_and_with_merge_a_merged_model(base_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollflow.cli import main

    trainer = lora_trainer(base_model, lr=1e-2)
    for seed in (1, 2):
        assert step(trainer, base_model, seed=seed).updated
    checkpoint = tmp_path / "step"
    trainer.save_checkpoint(checkpoint)
    (checkpoint / "state.json").write_text('{"step": 2, "policy_version": 2}')
    assert main(["export", str(checkpoint), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0

    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(tmp_path / "adapter")).eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(peft_model(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


async def test_an_adapter_on_the_tied_head_changes_the_logits_and_not_the_embeddings(base_model, tmp_path):
    """The random-init tiny model's head: the engine unties it to merge, and so does ``export --merge``."""
    from transformers import AutoModelForCausalLM

    from rollflow.cli import main
    from rollflow.inference.engine.engine import TorchEngine

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "lm_head"])
    trainer = Trainer(copy.deepcopy(base_model), TrainerConfig(micro_batch_size=3, lr=1e-2, lora=lora))
    for seed in (1, 2):
        assert step(trainer, base_model, seed=seed).updated
    embed = base_model.model.embed_tokens.weight
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    engine = TorchEngine(copy.deepcopy(base_model), max_batch_size=1, max_model_len=64)
    try:
        await engine.load_weights(trainer.named_weights(), policy_version=1)
        await engine.load_weights(trainer.named_weights(), policy_version=2)  # onto the base again
        with torch.no_grad():
            expected = trainer.model.eval()(input_ids=ids).logits
            torch.testing.assert_close(engine.model(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(engine.model.model.embed_tokens.weight, embed)
        assert not torch.equal(engine.model.lm_head.weight, embed)
    finally:
        await engine.shutdown()
    checkpoint = tmp_path / "step"
    trainer.save_checkpoint(checkpoint)
    (checkpoint / "state.json").write_text('{"step": 2, "policy_version": 2}')
    assert main(["export", str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(merged.model.embed_tokens.weight, embed)
