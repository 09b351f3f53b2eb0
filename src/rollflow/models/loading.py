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


def load_causal_lm(model_dir: Path, *, device: Any = "cpu", dtype: Any = None) -> Any:
    """Load the model in eval mode (no dropout: sampler and trainer must agree).

    transformers (v5) builds the model on the meta device and then reads the memory-mapped safetensors into
    it, so no randomly initialised copy is ever allocated: a process holds one copy of the weights. For a
    CUDA ``device`` that copy is read on the CPU and then moved (``device_map`` would read straight to the
    GPU but needs ``accelerate``, which rollflow does not depend on), so CPU memory briefly holds the weights
    once, in ``dtype``.

    Args:
        model_dir: a resolved model directory (``resolve_model_path``).
        device: where the weights go (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``).
        dtype: dtype of the weights; None is float32.
    """
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    if device.type != "cpu":
        model.to(device)
    return model.eval()


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


def resolve_device(name: str, key: str) -> Any:
    """The ``torch.device`` for a configured ``auto`` | ``cpu`` | ``cuda`` (``auto``: CUDA when available).

    Args:
        name: the configured value.
        key: the config key (or command-line flag) it came from, for the error message.

    Raises:
        ConfigError: an unknown name, or ``cuda`` on a machine where torch sees no CUDA device.
    """
    import torch

    if name not in DEVICES:
        raise ConfigError(f"{key} = {name!r} is not a device; use one of {', '.join(DEVICES)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{key} = 'cuda' but torch sees no CUDA device (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); use 'cpu' or 'auto', or run on a GPU machine"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: Any, key: str) -> Any:
    """The compute ``torch.dtype`` for a configured ``auto`` | ``float32`` | ``bfloat16`` on ``device``
    (``auto``: bfloat16 on CUDA devices that support it, else float32).

    Raises:
        ConfigError: an unknown name, or ``bfloat16`` on a CUDA device without bfloat16 support.
    """
    import torch

    if name not in DTYPES:
        raise ConfigError(f"{key} = {name!r} is not a dtype; use one of {', '.join(DTYPES)}")
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_ok else torch.float32
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(
            f"{key} = 'bfloat16' is not supported by {torch.cuda.get_device_name(device)} "
            f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}, "
            "bfloat16 needs 8.0 or newer); use 'float32'"
        )
    return getattr(torch, name)


def check_devices(config: Any) -> None:
    """Resolve every device and dtype a run config names, so a bad one fails before anything starts.

    Raises:
        ConfigError: see ``resolve_device`` and ``resolve_dtype``; the message names the key.
    """
    trainer_device = resolve_device(config.trainer.device, "trainer.device")
    resolve_dtype(config.trainer.dtype, trainer_device, "trainer.dtype")
    if config.inference.engine == "torch" and not (
        config.inference.mode == "http"
        and (config.inference.external_proxy_url or config.inference.external_server_urls)
    ):
        resolve_device(config.inference.device, "inference.device")


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
