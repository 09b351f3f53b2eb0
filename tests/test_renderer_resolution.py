"""``model.renderer = "auto"``: the renderer follows the model's Hugging Face name (never the snapshot path),
honours ``model.enable_thinking``, and a generic fallback for a model with a chat template is a warning."""

from __future__ import annotations

import json
import shutil

import pytest
from structlog.testing import capture_logs

from rollflow.config import ModelConfig
from rollflow.models.loading import (
    create_chat_renderer,
    load_tokenizer,
    model_hf_name,
    resolve_model_path,
    resolve_renderer_name,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a word."}]


def fake_cache_entry(hub, repo_id, tiny_model_dir, revision="0123456789abcdef0123456789abcdef01234567"):
    """The tiny model's files laid out as the HF hub cache holds ``repo_id`` (``models--Org--Name``)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    return hub


def test_hf_name_comes_from_the_cache_layout_not_the_snapshot_path(hub, tiny_model_dir):
    snapshot = fake_cache_entry(hub, "Qwen/Qwen3-0.6B", tiny_model_dir)
    assert resolve_model_path("Qwen/Qwen3-0.6B") == snapshot
    assert model_hf_name("Qwen/Qwen3-0.6B", snapshot) == "Qwen/Qwen3-0.6B"
    assert model_hf_name(str(snapshot)) == "Qwen/Qwen3-0.6B"
    assert model_hf_name("rollflow:tiny", tiny_model_dir) is None
    for path in ("Qwen/Qwen3-0.6B", str(snapshot)):
        config = ModelConfig(path=path)
        assert resolve_renderer_name(config, resolve_model_path(path)) == "qwen3", path


def test_hf_name_from_config_name_or_path(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "my-checkout"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "_name_or_path": "Qwen/Qwen3-8B"}))
    assert model_hf_name(str(model_dir)) == "Qwen/Qwen3-8B"
    assert resolve_renderer_name(ModelConfig(path=str(model_dir)), model_dir) == "qwen3"
    # A path in _name_or_path (what save_pretrained of a local model writes) is no name.
    (model_dir / "config.json").write_text(json.dumps({**config, "_name_or_path": str(tmp_path / "x")}))
    assert model_hf_name(str(model_dir)) is None


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_auto_renderer_honours_enable_thinking(hub, tiny_model_dir, enable_thinking):
    fake_cache_entry(hub, "Qwen/Qwen3-0.6B", tiny_model_dir)
    model_dir = resolve_model_path("Qwen/Qwen3-0.6B")
    tokenizer = load_tokenizer(model_dir)
    config = ModelConfig(path="Qwen/Qwen3-0.6B", enable_thinking=enable_thinking)
    with capture_logs() as logs:
        renderer = create_chat_renderer(tokenizer, config)
    assert [entry["renderer"] for entry in logs if entry["event"] == "chat renderer"] == ["qwen3"]
    assert not [entry for entry in logs if entry["log_level"] == "warning"]
    rendered = tokenizer.decode(renderer.render_ids(MESSAGES, add_generation_prompt=True))
    templated = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    assert rendered == templated
    # Thinking off closes an empty think block in the generation prompt; on leaves it to the model.
    assert rendered.endswith("<think>\n\n</think>\n\n") is not enable_thinking


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_unknown_model_falls_back_to_its_chat_template_with_a_warning(hub, tiny_model_dir, enable_thinking):
    fake_cache_entry(hub, "Acme/Mystery-1B", tiny_model_dir)
    model_dir = resolve_model_path("Acme/Mystery-1B")
    tokenizer = load_tokenizer(model_dir)
    config = ModelConfig(path="Acme/Mystery-1B", enable_thinking=enable_thinking)
    with capture_logs() as logs:
        renderer = create_chat_renderer(tokenizer, config, model_dir)
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1 and "model.renderer" in warnings[0]["event"], logs
    assert warnings[0]["hf_name"] == "Acme/Mystery-1B"
    assert [entry["renderer"] for entry in logs if entry["event"] == "chat renderer"] == ["default"]
    rendered = tokenizer.decode(renderer.render_ids(MESSAGES, add_generation_prompt=True))
    templated = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    assert rendered == templated


def test_explicit_renderer_is_kept_without_warning(hub, tiny_model_dir):
    fake_cache_entry(hub, "Acme/Mystery-1B", tiny_model_dir)
    model_dir = resolve_model_path("Acme/Mystery-1B")
    with capture_logs() as logs:
        assert (
            resolve_renderer_name(ModelConfig(path="Acme/Mystery-1B", renderer="qwen3"), model_dir) == "qwen3"
        )
    assert not logs
