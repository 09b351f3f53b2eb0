"""Checkpoints of a ``[trainer.lora]`` trainer: the adapter and its optimizer state, not the frozen base.

Layout, inside the checkpoint directory:
- ``adapter/``: a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``, and the base
  model's tokenizer files): ``PeftModel.from_pretrained(base, "adapter")`` loads it; ``rollflow export``
  copies it, or merges it into the base with ``--merge``.
- a single trainer: ``optimizer.pt`` (optimizer, schedule and RNG state; the optimizer holds the adapter only).
- data-parallel workers: ``trainer_state/`` (DCP) with the adapter's shards and their optimizer state, so the
  checkpoint resumes on any number of workers (``rollflow.train.sharded``), and ``trainer_rng.pt``.

Either form loads in the other: the adapter's full tensors are in ``adapter/`` in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollflow.errors import CheckpointError

ADAPTER_DIR = "adapter"


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters under the model's own names, whole (a DTensor shard is gathered: a collective
    every rank must join, in the same order), on the CPU."""
    state = {}
    for name, parameter in model.named_parameters():
        if is_adapter_parameter(name):
            tensor = parameter.detach()
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            state[name] = tensor.to("cpu", copy=True)
    return state


def save_adapter(model: torch.nn.Module, lora: Any, directory: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``directory/adapter/`` from ``state`` (``full_adapter_state``): the PEFT adapter directory."""
    from rollflow.train.export import copy_tokenizer_files
    from rollflow.train.lora import adapted_modules, adapter_config_json, peft_state_dict, write_adapter_dir

    base = str(getattr(model, "name_or_path", "") or "") or None
    target = directory / ADAPTER_DIR
    write_adapter_dir(target, peft_state_dict(state), adapter_config_json(lora, adapted_modules(model), base))
    if base is not None and Path(base).is_dir():
        copy_tokenizer_files(Path(base), target)


def read_adapter(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter of checkpoint ``directory`` under the model's own parameter names, checked against the
    model's adapter (names and shapes) before anything is loaded.

    Raises:
        CheckpointError: no ``adapter/``, an unreadable file, or an adapter of another shape.
    """
    from safetensors.torch import load_file

    from rollflow.train.lora import ADAPTER_WEIGHTS_FILE, training_state_dict

    path = directory / ADAPTER_DIR / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no {ADAPTER_DIR}/{ADAPTER_WEIGHTS_FILE}: it was not written by a "
            "trainer with [trainer.lora] (resume it without trainer.lora), or it is incomplete"
        )
    try:
        state = training_state_dict(load_file(path))
    except Exception as error:
        raise CheckpointError(f"cannot read {path} (corrupt or truncated?): {error}") from error
    expected = {name: tuple(p.shape) for name, p in model.named_parameters() if is_adapter_parameter(name)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{name} {tuple(state[name].shape)} != {expected[name]}"
        for name in set(state) & set(expected)
        if tuple(state[name].shape) != expected[name]
    )
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{path} does not fit this model's adapter: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {wrong[:3]}; resume with the trainer.lora (rank, target_modules) it was written with"
        )
    return state
