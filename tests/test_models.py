"""The embedded tiny model: deterministic local build, renderer compatibility, clear errors."""

from __future__ import annotations

import json

import pytest

from rollflow.config import ModelConfig
from rollflow.errors import ConfigError, ModelNotFoundError
from rollflow.models.loading import create_chat_renderer, load_causal_lm, load_tokenizer, resolve_model_path
from rollflow.models.tiny import TINY_MOE_ARCHITECTURE, ensure_tiny_model, ensure_tiny_moe_model


def test_tiny_build_is_deterministic_and_cached(tmp_path, monkeypatch):
    builds = []
    for name in ("a", "b"):
        monkeypatch.setenv("ROLLFLOW_CACHE_DIR", str(tmp_path / name))
        builds.append(ensure_tiny_model())
    for filename in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (builds[0] / filename).read_bytes() == (builds[1] / filename).read_bytes(), filename
    # A second call reuses the cached build instead of rebuilding it.
    stamp = (builds[1] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == builds[1]
    assert (builds[1] / "model.safetensors").stat().st_mtime_ns == stamp


def _config_without_writer(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    return config


def test_tiny_moe_is_a_deterministic_qwen3_moe_with_tinys_tokenizer(
    tmp_path, monkeypatch, tiny_moe_model_dir
):
    monkeypatch.setenv("ROLLFLOW_CACHE_DIR", str(tmp_path))
    built = resolve_model_path("rollflow:tiny-moe")
    assert built == ensure_tiny_moe_model() and built.parent == tmp_path
    for filename in ("tokenizer.json", "model.safetensors"):
        assert (built / filename).read_bytes() == (tiny_moe_model_dir / filename).read_bytes(), filename
    # The shared cache's build may come from another transformers release, which config.json names.
    assert _config_without_writer(built) == _config_without_writer(tiny_moe_model_dir)
    assert (built / "tokenizer.json").read_bytes() == (ensure_tiny_model() / "tokenizer.json").read_bytes()
    model = load_causal_lm(built)
    assert model.config.model_type == "qwen3_moe"
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    assert model.config.num_hidden_layers == TINY_MOE_ARCHITECTURE["num_hidden_layers"]
    renderer = create_chat_renderer(load_tokenizer(built), ModelConfig(path="rollflow:tiny-moe"))
    assert renderer.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)


@pytest.mark.parametrize(
    ("name", "model_type"), [("rollflow:tiny-h32", "qwen3"), ("rollflow:tiny-moe-h32", "qwen3_moe")]
)
def test_h32_twins_have_heads_vllm_cpu_serves_and_tinys_tokenizer(tmp_path, monkeypatch, name, model_type):
    # vLLM's CPU attention serves head sizes of 32 and up only: these twins are what it can serve.
    monkeypatch.setenv("ROLLFLOW_CACHE_DIR", str(tmp_path))
    built = resolve_model_path(name)
    assert built.parent == tmp_path and resolve_model_path(name) == built  # built once, then cached
    assert (built / "tokenizer.json").read_bytes() == (ensure_tiny_model() / "tokenizer.json").read_bytes()
    model = load_causal_lm(built)
    config = model.config
    assert config.model_type == model_type
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (32, 2, 1)
    assert config.hidden_size == TINY_MOE_ARCHITECTURE["hidden_size"]
    # The same size as its head_dim-16 original (q/k/v widths are equal; only the per-head norms grow).
    original = load_causal_lm(ensure_tiny_model() if model_type == "qwen3" else ensure_tiny_moe_model())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - sum(p.numel() for p in original.parameters())) <= 0.01 * count
    renderer = create_chat_renderer(load_tokenizer(built), ModelConfig(path=name))
    assert renderer.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_tiny_long_is_tiny_with_more_positions(tmp_path, monkeypatch, tiny_model_dir):
    import torch

    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.tiny import TINY_LONG_POSITIONS

    monkeypatch.setenv("ROLLFLOW_CACHE_DIR", str(tmp_path))
    built = resolve_model_path("rollflow:tiny-long")
    assert built.parent == tmp_path and resolve_model_path("rollflow:tiny-long") == built
    for filename in ("tokenizer.json", "model.safetensors"):
        assert (built / filename).read_bytes() == (tiny_model_dir / filename).read_bytes(), filename
    long, tiny = load_causal_lm(built), load_causal_lm(tiny_model_dir)
    assert long.config.max_position_embeddings == TINY_LONG_POSITIONS
    assert load_tokenizer(built).model_max_length == TINY_LONG_POSITIONS
    ids = torch.arange(1, 1500)[None] % len(load_tokenizer(built))
    with torch.no_grad():
        assert torch.equal(long(ids).logits, tiny(ids).logits)  # the same model where tiny has positions
    TorchEngine(long, max_batch_size=1, max_model_len=4096)  # and an engine takes it past tiny's 2048
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        TorchEngine(tiny, max_batch_size=1, max_model_len=4096)


def test_tiny_tokenizer_has_the_qwen3_specials(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "Reply in UPPERCASE: name a fruit. 12 + 30 = 42"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_renderer_matches_the_chat_template(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a word."}]
    rendered = renderer.render_ids(messages, add_generation_prompt=True)
    templated = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert tokenizer.decode(rendered) == templated
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in renderer.get_stop_token_ids()


def test_local_directory_resolves(tiny_model_dir):
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_path("no-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_path(str(tmp_path))


def test_unknown_renderer_names_the_key(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ConfigError, match="model.renderer"):
        create_chat_renderer(tokenizer, ModelConfig(renderer="no-such-renderer"))
