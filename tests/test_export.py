"""The Hugging Face model directory in each checkpoint: loads with ``from_pretrained`` as is, same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflow.config import TrainerConfig
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.checkpoint import load_policy_weights
from rollflow.train.export import HF_DIR, save_hf_model

from .helpers.training import PackingTrainer, make_batch


def test_checkpoint_hf_directory_loads_as_is_with_the_trained_logits(tiny_model_dir, tmp_path):
    trainer = PackingTrainer(load_causal_lm(tiny_model_dir), TrainerConfig(lr=1e-2), pad_token_id=0)
    initial = {name: tensor.clone() for name, tensor in trainer.named_weights()}
    assert trainer.train_step(make_batch(trainer.model)).updated
    trainer.save_checkpoint(tmp_path / "step")
    hf_dir = tmp_path / "step" / HF_DIR

    loaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert loaded.dtype == next(trainer.model.parameters()).dtype  # the training dtype
    input_ids = torch.tensor([[5, 17, 42, 99, 3, 300, 2, 7]])
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=input_ids).logits
        got = loaded(input_ids=input_ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # ... and those are the trained weights, not the initial ones.
    assert any(not torch.equal(initial[name], tensor) for name, tensor in loaded.state_dict().items())

    generation_config = json.loads((hf_dir / "generation_config.json").read_text())
    source_generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == source_generation["eos_token_id"]
    tokenizer, source_tokenizer = (
        AutoTokenizer.from_pretrained(hf_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    text = "What is 12 + 30?"
    assert tokenizer(text).input_ids == source_tokenizer(text).input_ids
    assert tokenizer.chat_template == source_tokenizer.chat_template


def test_export_of_gathered_weights_and_generate_reads_them(tiny_model_dir, tmp_path):
    """A sharded trainer passes its gathered state dict; ``load_policy_weights`` (``rollflow generate
    --checkpoint``) prefers the HF directory over the trainer's own file."""
    model = load_causal_lm(tiny_model_dir)
    gathered = {name: torch.full_like(tensor, 0.25) for name, tensor in model.state_dict().items()}
    save_hf_model(model, tmp_path / "ckpt" / HF_DIR, state_dict=gathered)
    (tmp_path / "ckpt" / "state.json").write_text(json.dumps({"step": 3, "policy_version": 3}))
    weights, version = load_policy_weights(tmp_path / "ckpt")
    assert version == 3
    assert weights and all(torch.equal(t, torch.full_like(t, 0.25)) for t in weights.values())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / HF_DIR)
    assert all(torch.equal(t, torch.full_like(t, 0.25)) for t in loaded.state_dict().values())


def test_a_corrupt_hf_directory_is_a_clear_error(tmp_path):
    from rollflow.errors import CheckpointError

    (tmp_path / HF_DIR).mkdir()
    (tmp_path / HF_DIR / "model.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "state.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    with pytest.raises(CheckpointError, match="no readable hf/model.safetensors"):
        load_policy_weights(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_files_get_the_mode_the_umask_allows(tiny_model_dir, tmp_path, umask):
    # safetensors writes 0600 whatever the umask: another user (a server run under its own account) could
    # not load the checkpoint's weights or its hf/ model.
    from rollflow.orchestrator.checkpoint import OrchestratorState, save_checkpoint

    trainer = PackingTrainer(load_causal_lm(tiny_model_dir), TrainerConfig(lr=1e-2), pad_token_id=0)
    previous = os.umask(umask)
    try:
        checkpoint = save_checkpoint(tmp_path, OrchestratorState(step=1), trainer.save_checkpoint, keep=1)
    finally:
        os.umask(previous)
    files = [path for path in checkpoint.rglob("*") if path.is_file()]
    assert any(path.suffix == ".safetensors" for path in files) and (checkpoint / HF_DIR).is_dir()
    modes = {path.relative_to(checkpoint).as_posix(): oct(path.stat().st_mode & 0o777) for path in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
