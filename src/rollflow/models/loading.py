"""Resolve, load and render for a configured model: ``rollflow:tiny`` (or ``rollflow:tiny-moe``), a local
directory or a cached HF name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollflow.errors import ConfigError, ModelNotFoundError
from rollflow.models.tiny import (
    TINY_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    ensure_tiny_model,
    ensure_tiny_moe_model,
)

# The embedded models, built locally on first use; both use tiny's Qwen3-format tokenizer.
EMBEDDED_MODELS = {TINY_MODEL_NAME: ensure_tiny_model, TINY_MOE_MODEL_NAME: ensure_tiny_moe_model}

if TYPE_CHECKING:
    from rollflow.config import ModelConfig


def resolve_model_path(path: str) -> Path:
    """Turn ``model.path`` into a local directory, never touching the network.

    Raises:
        ModelNotFoundError: the path is neither a model directory nor a name in the local HF cache.
    """
    if path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[path]()
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelNotFoundError(
                f"model.path = {path!r} is a directory without config.json; point it at a Hugging Face "
                "model directory (with config.json, weights and tokenizer files)"
            )
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:
        raise ModelNotFoundError(
            f"model.path = {path!r} is not a local directory and not in the local Hugging Face cache "
            f"(HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}). Download it first, "
            f"or use {TINY_MODEL_NAME!r} for the embedded tiny model"
        ) from None


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    _quiet_transformers()
    return AutoTokenizer.from_pretrained(model_dir)


def load_causal_lm(model_dir: Path) -> Any:
    """Load the model in float32 on CPU, in eval mode (no dropout: sampler and trainer must agree)."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def create_chat_renderer(tokenizer: Any, config: ModelConfig) -> Any:
    """Build the ``renderers`` renderer for chat prompts.

    Raises:
        ConfigError: ``model.renderer`` names no renderer, or the renderer rejects the tokenizer.
    """
    import renderers

    name = config.renderer
    if name == "auto" and config.path in EMBEDDED_MODELS:
        name = "qwen3"
    try:
        if name == "auto":
            return renderers.create_renderer(tokenizer)
        renderer_config = renderers.config_from_name(name)
        if "enable_thinking" in type(renderer_config).model_fields:
            renderer_config = renderer_config.model_copy(update={"enable_thinking": config.enable_thinking})
        return renderers.create_renderer(tokenizer, renderer_config)
    except (ValueError, KeyError, AssertionError) as error:
        raise ConfigError(
            f"model.renderer = {config.renderer!r} could not render for model {config.path!r}: {error}"
        ) from None
