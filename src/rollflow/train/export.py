"""The Hugging Face model directory each checkpoint holds (``checkpoints/step_NNNNNN/hf/``).

It is what leaves the run: ``AutoModelForCausalLM.from_pretrained`` (and ``vllm serve``) load it as is. It holds
the model in the training dtype (``save_pretrained``: safetensors + ``config.json``), ``generation_config.json``
and the tokenizer files of the model the run started from. The trainer's own resume state (optimizer, RNG,
sharded weights) lives beside it, not in it.

The export runs where the full weights are: the single-process trainer, or rank 0 of a data-parallel group
after gathering (pass the gathered ``state_dict``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

HF_DIR = "hf"
"""The subdirectory of a checkpoint holding the Hugging Face model."""
GENERATION_CONFIG_FILE = "generation_config.json"
# What a tokenizer may be made of (fast and slow tokenizers, sentencepiece, chat templates).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def save_hf_model(
    model: Any,
    directory: str | Path,
    *,
    state_dict: Mapping[str, Any] | None = None,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face model directory at ``directory`` and return it.

    Args:
        model: a ``transformers`` causal LM (its ``config`` and ``generation_config`` are written).
        directory: created if missing; files already there are overwritten.
        state_dict: the full weights to write instead of ``model.state_dict()`` (a sharded model's gathered
            state dict); tied duplicates are dropped as ``save_pretrained`` does.
        tokenizer_dir: where the tokenizer files come from; default ``model.name_or_path`` when it is a local
            directory (the model directory the trainer loaded). Nothing is copied when neither exists.
    """
    from transformers import GenerationConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {} if state_dict is None else {"state_dict": dict(state_dict)}
    model.save_pretrained(directory, **options)
    if not (directory / GENERATION_CONFIG_FILE).is_file():
        generation_config = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(
            model.config
        )
        generation_config.save_pretrained(directory)
    source = (
        Path(tokenizer_dir) if tokenizer_dir is not None else _local_dir(getattr(model, "name_or_path", ""))
    )
    copied = copy_tokenizer_files(source, directory) if source is not None else []
    if not copied:
        log.warning(
            "no tokenizer files copied into the exported model", directory=str(directory), source=source
        )
    return directory


def copy_tokenizer_files(source: Path, directory: Path) -> list[str]:
    """Copy the tokenizer files ``source`` has into ``directory``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
            copied.append(name)
    return copied


def _local_dir(path: str | Path) -> Path | None:
    return Path(path) if path and Path(path).is_dir() else None
