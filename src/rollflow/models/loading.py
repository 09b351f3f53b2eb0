"""Resolve, load and render for a configured model: ``rollflow:tiny`` (or ``rollflow:tiny-moe``), a local
directory or a cached HF name."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.errors import ConfigError, ModelNotFoundError
from rollflow.models.fast_tokenizer import copy_batch_encoding, with_fast_paths
from rollflow.models.tiny import (
    TINY_H32_MODEL_NAME,
    TINY_LONG_MODEL_NAME,
    TINY_MODEL_NAME,
    TINY_MOE_H32_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    ensure_tiny_h32_model,
    ensure_tiny_long_model,
    ensure_tiny_model,
    ensure_tiny_moe_h32_model,
    ensure_tiny_moe_model,
)

# The embedded models, built locally on first use; all use tiny's Qwen3-format tokenizer.
EMBEDDED_MODELS = {
    TINY_MODEL_NAME: ensure_tiny_model,
    TINY_MOE_MODEL_NAME: ensure_tiny_moe_model,
    TINY_H32_MODEL_NAME: ensure_tiny_h32_model,
    TINY_MOE_H32_MODEL_NAME: ensure_tiny_moe_h32_model,
    TINY_LONG_MODEL_NAME: ensure_tiny_long_model,
}


def _log() -> Any:
    # A logger per call, not one cached at import: the CLI configures structlog after this module is imported
    # (and tests capture what the renderer choice logs).
    return structlog.get_logger(__name__)


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
    """The model's tokenizer, answering the renderers' per-turn calls straight from its backend
    (``rollflow.models.fast_tokenizer``) and remembering short texts' ids (``ShortTextEncodeCache``,
    ``OffsetsProbeCache``)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    tokenizer = with_fast_paths(AutoTokenizer.from_pretrained(model_dir))
    _cache_short_encodes(tokenizer)
    return tokenizer


class ShortTextEncodeCache:
    """``tokenizer.encode`` that remembers the ids of short texts (``max_chars`` at most).

    Chat renderers encode the same few short strings on every turn (role headers, reasoning markers, "\\n");
    through transformers each ``encode`` costs tens of microseconds of Python, several times per request.
    Encoding is deterministic, so the ids of a short text are kept (``max_entries`` texts, then the memory
    starts over) and each call gets its own copy of the list. Calls with other arguments, or longer texts, go to
    the tokenizer's own ``encode``. The memory is not pickled (a pickled tokenizer starts with an empty one).
    """

    def __init__(self, tokenizer: Any, max_chars: int = 64, max_entries: int = 4096):
        self._encode = type(tokenizer).encode.__get__(tokenizer)
        self.max_chars = max_chars
        self.max_entries = max_entries
        self._ids: dict[tuple[str, bool], tuple[int, ...]] = {}

    def __call__(self, text: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(text, str) or len(text) > self.max_chars:
            return self._encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        key = (text, add_special_tokens)
        ids = self._ids.get(key)
        if ids is None:
            ids = tuple(self._encode(text, add_special_tokens=add_special_tokens))
            if len(self._ids) >= self.max_entries:
                self._ids.clear()
            self._ids[key] = ids
        return list(ids)

    def forget(self) -> None:
        """Drop what was remembered (the tokenizer's vocabulary changed)."""
        self._ids.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShortTextEncodeCache, (self._encode.__self__, self.max_chars, self.max_entries))


_UNSET = object()  # an argument not given (OffsetsProbeCache's keys)


class OffsetsProbeCache:
    """``tokenizer.__call__`` as read by ``getattr(tokenizer, "__call__")``, remembering short calls.

    The ``renderers`` package asks, on every render, whether the tokenizer gives character offsets by calling
    ``getattr(tokenizer, "__call__")("a", add_special_tokens=False, return_offsets_mapping=True)``: about a
    quarter of a turn's render. Calls through ``tokenizer(...)`` never reach this (Python looks ``__call__`` up
    on the class); calls through the attribute with one short text and only ``add_special_tokens`` /
    ``return_offsets_mapping`` are answered from memory, each with its own copy of the mapping.
    """

    _REMEMBERED = frozenset({"add_special_tokens", "return_offsets_mapping"})

    def __init__(self, tokenizer: Any, max_chars: int = 64, max_entries: int = 256):
        self._call = type(tokenizer).__call__.__get__(tokenizer)
        self.max_chars = max_chars
        self.max_entries = max_entries
        self._encodings: dict[tuple[Any, ...], Any] = {}

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (
            args
            or not isinstance(text, str)
            or len(text) > self.max_chars
            or not kwargs.keys() <= self._REMEMBERED
        ):
            return self._call(text, *args, **kwargs)
        key = (text, kwargs.get("add_special_tokens", _UNSET), kwargs.get("return_offsets_mapping", _UNSET))
        encoding = self._encodings.get(key)
        if encoding is None:
            encoding = self._call(text, **kwargs)
            if len(self._encodings) >= self.max_entries:
                self._encodings.clear()
            self._encodings[key] = encoding
        return copy_batch_encoding(encoding) if hasattr(encoding, "copy") else encoding

    def forget(self) -> None:
        """Drop what was remembered (the tokenizer's vocabulary changed)."""
        self._encodings.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        return (OffsetsProbeCache, (self._call.__self__, self.max_chars, self.max_entries))


def _cache_short_encodes(tokenizer: Any) -> None:
    if callable(getattr(type(tokenizer), "encode", None)):
        tokenizer.encode = ShortTextEncodeCache(tokenizer)
    if callable(tokenizer):
        tokenizer.__call__ = OffsetsProbeCache(tokenizer)


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


def empty_causal_lm(model_dir: Path) -> Any:
    """The model's architecture on the meta device (float32, eval mode), reading no weights: for a process that
    receives its weights from another (a data-parallel rank other than 0, filled by
    ``set_model_state_dict(..., broadcast_from_rank0=True)``), so that only one process per node reads and
    holds a full copy.

    Give it memory with ``materialize(model, device)`` (or ``to_empty`` after sharding, for FSDP2, then
    ``tie_weights`` and ``restore_non_persistent_buffers``): ``to_empty`` unties tied weights and leaves the
    buffers outside the state dict (rotary ``inv_freq``) uninitialised.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def materialize(model: Any, device: Any = "cpu") -> Any:
    """Allocate (uninitialised) memory on ``device`` for a model from ``empty_causal_lm``, tie its weights
    again and restore its non-persistent buffers; the weights are then ready for ``load_state_dict``."""
    model.to_empty(device=device)
    model.tie_weights()
    restore_non_persistent_buffers(model)
    return model


def restore_non_persistent_buffers(model: Any) -> None:
    """Recompute the buffers no state dict carries (rotary ``inv_freq`` and the like) of a model that was
    built on the meta device and materialised with ``to_empty``: each module holding such buffers is built
    again on the CPU from its own ``config`` and its buffers copied over.

    Raises:
        TypeError: a module with non-persistent buffers cannot be rebuilt from its ``config``.
    """
    import torch

    for name, module in model.named_modules():
        buffers = [
            b for b in getattr(module, "_non_persistent_buffers_set", ()) if getattr(module, b) is not None
        ]
        if not buffers:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise TypeError(
                f"module {name!r} ({type(module).__name__}) has non-persistent buffers {buffers} but no config "
                "to rebuild them from; load this model with load_causal_lm instead"
            )
        with torch.device("cpu"):
            fresh = type(module)(config=config)
        with torch.no_grad():
            for buffer in buffers:
                getattr(module, buffer).copy_(getattr(fresh, buffer))
        for attribute in ("attention_scaling",):
            if hasattr(fresh, attribute):
                setattr(module, attribute, getattr(fresh, attribute))


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


def model_hf_name(path: str, model_dir: Path | None = None) -> str | None:
    """The model's Hugging Face name (``Org/Name``) for ``model.path``, or None when it has none.

    A name in the HF cache is its own name; a directory inside the cache (``models--Org--Name/snapshots/<hash>``,
    as ``resolve_model_path`` returns) gives the name back from the cache layout; any other directory gives its
    ``config.json``'s ``_name_or_path`` when that is a hub name rather than a path.
    """
    if path in EMBEDDED_MODELS:
        return None
    local = Path(path).expanduser()
    if not local.is_dir() and _HUB_NAME.fullmatch(path):
        return path
    directory = model_dir if model_dir is not None else (local if local.is_dir() else None)
    if directory is None:
        return None
    for candidate in (Path(directory).expanduser().absolute(), Path(directory).expanduser().resolve()):
        parts = candidate.parts
        for index, part in enumerate(parts[:-1]):
            if part.startswith("models--") and parts[index + 1] == "snapshots":
                return part.removeprefix("models--").replace("--", "/")
    try:
        name = json.loads((Path(directory) / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(name, str) and _HUB_NAME.fullmatch(name) and not Path(name).expanduser().exists():
        return name
    return None


# ``Org/Name`` as the hub spells repository ids (no path separators beyond the one, no ``..``).
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _has_chat_template(tokenizer: Any, model_dir: Path | None) -> bool:
    if getattr(tokenizer, "chat_template", None):
        return True
    if model_dir is None:
        return False
    if (model_dir / "chat_template.jinja").exists():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def resolve_renderer_name(config: ModelConfig, model_dir: Path | None = None, tokenizer: Any = None) -> str:
    """The concrete ``renderers`` name for ``model.renderer``: itself unless ``auto``; for ``auto``, qwen3 for
    the embedded models, else renderers' renderer for the model's HF name (``model_hf_name``: the cache
    layout, never the snapshot path), else the generic ``default`` (the tokenizer's chat template), with a
    warning naming ``model.renderer`` when the model has a chat template a specific renderer may match."""
    if config.renderer != "auto":
        return config.renderer
    if config.path in EMBEDDED_MODELS:
        return "qwen3"
    from renderers.base import MODEL_RENDERER_MAP

    hf_name = model_hf_name(config.path, model_dir)
    name = MODEL_RENDERER_MAP.get(hf_name) if hf_name else None
    if name is not None:
        return name
    if _has_chat_template(tokenizer, model_dir):
        _log().warning(
            "model.renderer = 'auto' found no renderer for this model; using the generic 'default' renderer "
            "(the tokenizer's chat template, without renderers' tool and thinking parsing). Set model.renderer "
            "to the renderer of the model family it was fine-tuned from (e.g. 'qwen3') if its template matches",
            model=config.path,
            hf_name=hf_name,
        )
    return "default"


def create_chat_renderer(tokenizer: Any, config: ModelConfig, model_dir: Path | None = None) -> Any:
    """Build the ``renderers`` renderer for chat prompts (``resolve_renderer_name`` picks it; logged), with
    ``model.enable_thinking`` applied: as the renderer's own field, or as a chat-template argument for the
    generic ``default`` renderer.

    Args:
        model_dir: the resolved model directory; defaults to the tokenizer's ``name_or_path`` when that is one.

    Raises:
        ConfigError: ``model.renderer`` names no renderer, or the renderer rejects the tokenizer.
    """
    import renderers

    if model_dir is None:
        source = getattr(tokenizer, "name_or_path", "") or ""
        model_dir = Path(source) if source and Path(source).is_dir() else None
    try:
        name = resolve_renderer_name(config, model_dir, tokenizer)
        renderer_config = renderers.config_from_name(name)
        template_kwargs = None
        if "enable_thinking" in type(renderer_config).model_fields:
            renderer_config = renderer_config.model_copy(update={"enable_thinking": config.enable_thinking})
        elif name == "default":
            template_kwargs = {"enable_thinking": config.enable_thinking}
        renderer = renderers.create_renderer(tokenizer, renderer_config, chat_template_kwargs=template_kwargs)
    except (ValueError, KeyError, AssertionError) as error:
        raise ConfigError(
            f"model.renderer = {config.renderer!r} could not render for model {config.path!r}: {error}"
        ) from None
    _log().info("chat renderer", renderer=name, configured=config.renderer, model=config.path)
    return renderer
