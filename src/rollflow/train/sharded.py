"""Sharded trainer checkpoints (``torch.distributed.checkpoint``) for data-parallel workers.

Layout, inside the checkpoint directory the orchestrator gives:
- ``trainer_state/``: model and optimizer state, each rank writing its own shards (DCP). DCP reshards on
  load, so a checkpoint written by N workers resumes on any number of them, or on a single trainer.
- ``model.safetensors`` (+ ``config.json``): the full weights, written by rank 0, in the single trainer's
  format (what ``rollflow export``, ``load_policy_weights`` and ``from_pretrained`` read).
- ``trainer_rng.pt``: rank 0's trainer RNG state.

A checkpoint of a single trainer (``model.safetensors`` + ``optimizer.pt``, no ``trainer_state/``) loads
here too: its full state dicts are handed to every rank, which keeps its shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from rollflow.errors import CheckpointError

STATE_DIR = "trainer_state"
RNG_FILE = "trainer_rng.pt"


def save_checkpoint(trainer: Any, directory: Path) -> None:
    """Collective: every rank of ``trainer.parallel`` calls it with the same ``directory``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from rollflow.train.checkpoint_io import OPTIMIZER_FILE, WEIGHTS_FILE, untied, write_atomically

    directory.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    lora = getattr(trainer, "lora", None)
    if lora is not None:  # the adapter and its optimizer state; the frozen base is not written
        from rollflow.train.lora_checkpoint import full_adapter_state, is_adapter_parameter, save_adapter

        model_state = {name: value for name, value in model_state.items() if is_adapter_parameter(name)}
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / STATE_DIR)
    if lora is not None:
        adapter = full_adapter_state(trainer.model)  # every rank joins each gather
        if trainer.parallel.rank == 0:
            save_adapter(trainer.model, lora, directory, adapter)
            write_atomically(
                directory / RNG_FILE, lambda path: torch.save(trainer.generator.get_state(), path)
            )
            (directory / OPTIMIZER_FILE).unlink(missing_ok=True)
        return
    full = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if trainer.parallel.rank != 0:
        return
    # Tied weights: the full state dict holds one tensor under both names, as the model's own does.
    weights = {name: tensor.contiguous() for name, tensor in untied(full).items()}
    write_atomically(
        directory / WEIGHTS_FILE, lambda path: save_file(weights, path, metadata={"format": "pt"})
    )
    if (model_config := getattr(trainer.model, "config", None)) is not None:
        model_config.save_pretrained(directory)
    write_atomically(directory / RNG_FILE, lambda path: torch.save(trainer.generator.get_state(), path))
    (directory / OPTIMIZER_FILE).unlink(missing_ok=True)  # never beside trainer_state/: one source of truth


def has_sharded_state(directory: Path) -> bool:
    return (Path(directory) / STATE_DIR / ".metadata").is_file()


def load_checkpoint(trainer: Any, directory: Path) -> None:
    """Collective like ``save_checkpoint``; also works without a process group (a single trainer).

    Raises:
        CheckpointError: the directory holds neither format, or its state does not fit this model.
    """
    directory = Path(directory)
    weights = "adapter/adapter_model.safetensors" if getattr(trainer, "lora", None) else "model.safetensors"
    if has_sharded_state(directory):
        _load_sharded(trainer, directory)
    elif (directory / "optimizer.pt").is_file() and (directory / weights).is_file():
        _load_full(trainer, directory)
    else:
        raise CheckpointError(
            f"checkpoint {directory} has neither {STATE_DIR}/ nor model.safetensors and optimizer.pt: it is "
            "incomplete or not a rollflow checkpoint; resume from a checkpoint directory a trainer wrote"
        )


def _load_sharded(trainer: Any, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    # Templates: this rank's shards (and, before the first step, the optimizer state DCP creates).
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    if getattr(trainer, "lora", None) is not None:  # the checkpoint holds the adapter alone
        from rollflow.train.lora_checkpoint import is_adapter_parameter

        model_state = {name: value for name, value in model_state.items() if is_adapter_parameter(name)}
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with warnings.catch_warnings():  # a single trainer loads without a process group, as intended
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=directory / STATE_DIR)
    except Exception as error:
        raise CheckpointError(
            f"cannot load {directory / STATE_DIR} into this model: {error}; resume with the model the "
            "checkpoint was trained from"
        ) from error
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=getattr(trainer, "lora", None) is None),
    )
    rng = directory / RNG_FILE
    if rng.is_file():
        trainer.generator.set_state(torch.load(rng, weights_only=True))


def _load_full(trainer: Any, directory: Path) -> None:
    """A single trainer's checkpoint: full weights, and optimizer state keyed by parameter index."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    lora = getattr(trainer, "lora", None) is not None
    try:
        weights = {} if lora else load_file(directory / "model.safetensors")
        saved = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"cannot read checkpoint {directory} (corrupt or truncated?): {error!r}"
        ) from error
    if lora:  # a single LoRA trainer's: the adapter (checked against the model's), the frozen base as it is
        from rollflow.train.lora_checkpoint import read_adapter

        weights = read_adapter(directory, trainer.model)
    else:
        for name, tied_to in _tied_names(trainer.model):
            if tied_to in weights:
                weights.setdefault(name, weights[tied_to])
        _check_weights(trainer.model, weights, directory / "model.safetensors")
    names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    optimizer = saved["optimizer"]
    # torch.optim numbers parameters in the order they were given: the model's named_parameters().
    by_name = {
        "state": {names[index]: value for index, value in optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in optimizer["param_groups"]
        ],
    }
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=weights,
        optim_state_dict=by_name,
        options=StateDictOptions(full_state_dict=True, strict=False),
    )
    trainer.generator.set_state(saved["rng_state"])


def _check_weights(model: Any, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Names and (global) shapes must match the model before anything is loaded."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong_shape = sorted(
        f"{name} {tuple(weights[name].shape)} != {tuple(expected[name].shape)}"
        for name in set(weights) & set(expected)
        if tuple(weights[name].shape) != tuple(expected[name].shape)
    )
    if missing or unexpected or wrong_shape:
        raise CheckpointError(
            f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong_shape[:5]}; resume with the model the checkpoint was trained from"
        )


def _tied_names(model: Any) -> list[tuple[str, str]]:
    """``(name, tied_to)`` for the state-dict names a safetensors file leaves out (tied duplicates)."""
    pairs = []
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        key = id(parameter)
        if key in first:
            pairs.append((name, first[key]))
        else:
            first[key] = name
    return pairs
