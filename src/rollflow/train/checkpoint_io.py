"""The trainer's state on disk and in memory: ``state_dict``/``load_state_dict`` and
``save_checkpoint``/``load_checkpoint`` (weights in safetensors, optimizer, schedule and RNG state in
``optimizer.pt``, a Hugging Face export beside them), each file written under a temporary name and renamed
into place, and checked against the model before anything is loaded. A mixin of ``Trainer`` over its model,
optimizer, scheduler and generator; ``rollflow.train.sharded`` writes the data-parallel workers' form."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rollflow.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class TrainerCheckpoints:
    """The checkpoint half of ``Trainer``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    device: torch.device

    def state_dict(self) -> dict[str, Any]:
        """Model weights, optimizer and learning-rate schedule state and the trainer's RNG state (live
        tensors, not copies)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned.

        Raises:
            CheckpointError: the state is incomplete or does not fit this model and optimizer.
        """
        missing = {"model", "optimizer", "rng_state"} - state.keys()
        if missing:
            raise CheckpointError(
                f"trainer state lacks {sorted(missing)}; pass what Trainer.state_dict() returns"
            )
        self._check_weights(state["model"], source="trainer state")
        self._load_optimizer_and_rng(
            state["optimizer"], state["rng_state"], state.get("scheduler"), source="trainer state"
        )
        self.model.load_state_dict(state["model"], strict=False)

    def save_checkpoint(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` (+ ``config.json`` when the model has one), ``optimizer.pt``, and the
        Hugging Face model directory ``hf/`` (``rollflow.train.export``: model in the training dtype,
        tokenizer, ``generation_config.json``) for a ``transformers`` model.

        Tied duplicates are dropped from the safetensors file (the first name of each shared tensor is kept,
        as ``save_pretrained`` does), so with ``config.json`` the directory also loads with
        ``from_pretrained``. Each file is written under a temporary name and renamed into place.
        """
        from safetensors.torch import save_file

        from rollflow.train.export import HF_DIR, save_hf_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if getattr(self, "lora", None) is not None:
            self._save_lora_checkpoint(directory)
            return
        weights = {name: tensor.contiguous() for name, tensor in untied(self.model.state_dict()).items()}
        write_atomically(
            directory / WEIGHTS_FILE, lambda path: save_file(weights, path, metadata={"format": "pt"})
        )
        if (model_config := getattr(self.model, "config", None)) is not None:
            model_config.save_pretrained(directory)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_state": self.generator.get_state(),
        }
        write_atomically(directory / OPTIMIZER_FILE, lambda path: torch.save(state, path))
        if hasattr(self.model, "save_pretrained"):
            save_hf_model(self.model, directory / HF_DIR)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore weights, optimizer state and RNG state written by ``save_checkpoint``.

        Both files are read and checked before anything is changed, so a bad checkpoint leaves the trainer
        as it was. The reference model (KL penalty) is not part of a checkpoint: it stays the model this
        trainer was built from, which should be the run's initial policy. A sharded checkpoint that
        data-parallel workers wrote (``rollflow.train.sharded``) loads too, whatever their number.

        Raises:
            CheckpointError: a file is missing, unreadable, or does not fit this model and optimizer.
        """
        from safetensors.torch import load_file

        from rollflow.train import sharded

        directory = Path(directory)
        weights_path, optimizer_path = directory / WEIGHTS_FILE, directory / OPTIMIZER_FILE
        if not optimizer_path.is_file() and sharded.has_sharded_state(directory):
            sharded.load_checkpoint(self, directory)  # written by data-parallel workers (any number)
            return
        if getattr(self, "lora", None) is not None:
            self._load_lora_checkpoint(directory)
            return
        for path in (weights_path, optimizer_path):
            if not path.is_file():
                raise CheckpointError(
                    f"checkpoint {directory} has no {path.name}: it is incomplete or not a rollflow checkpoint; "
                    "resume from a checkpoint directory written by Trainer.save_checkpoint"
                )
        try:
            weights = load_file(weights_path, device=str(self.device))
        except Exception as error:
            raise CheckpointError(f"cannot read {weights_path} (corrupt or truncated?): {error}") from error
        try:
            state = torch.load(optimizer_path, map_location=self.device, weights_only=True)
            optimizer_state, rng_state = state["optimizer"], state["rng_state"]
            scheduler_state = state.get("scheduler")  # absent in checkpoints older than lr schedules
        except Exception as error:
            raise CheckpointError(
                f"cannot read {optimizer_path} (corrupt or truncated?): {error!r}"
            ) from error

        self._check_weights(weights, source=str(weights_path))
        self._load_optimizer_and_rng(
            optimizer_state, rng_state.cpu(), scheduler_state, source=str(optimizer_path)
        )
        self.model.load_state_dict(weights, strict=False)

    def _save_lora_checkpoint(self, directory: Path) -> None:
        """``[trainer.lora]``: ``adapter/`` (PEFT) and ``optimizer.pt``; the frozen base is not written
        (``rollflow.train.lora_checkpoint``)."""
        from rollflow.train.lora_checkpoint import full_adapter_state, save_adapter

        save_adapter(self.model, self.lora, directory, full_adapter_state(self.model))
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_state": self.generator.get_state(),
        }
        write_atomically(directory / OPTIMIZER_FILE, lambda path: torch.save(state, path))

    def _load_lora_checkpoint(self, directory: Path) -> None:
        from rollflow.train.lora_checkpoint import read_adapter

        optimizer_path = directory / OPTIMIZER_FILE
        adapter = read_adapter(directory, self.model)
        if not optimizer_path.is_file():
            raise CheckpointError(
                f"checkpoint {directory} has no {OPTIMIZER_FILE}: it is incomplete or not a rollflow checkpoint"
            )
        try:
            state = torch.load(optimizer_path, map_location=self.device, weights_only=True)
            optimizer_state, rng_state = state["optimizer"], state["rng_state"]
        except Exception as error:
            raise CheckpointError(
                f"cannot read {optimizer_path} (corrupt or truncated?): {error!r}"
            ) from error
        self._load_optimizer_and_rng(
            optimizer_state, rng_state.cpu(), state.get("scheduler"), source=str(optimizer_path)
        )
        self.model.load_state_dict({name: t.to(self.device) for name, t in adapter.items()}, strict=False)

    def _check_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Names and shapes must match the model (tied duplicates may be absent) before anything is loaded."""
        expected = self.model.state_dict()
        required = untied(expected)
        missing = sorted(set(required) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        wrong_shape = sorted(
            f"{name} {tuple(weights[name].shape)} != {tuple(expected[name].shape)}"
            for name in set(weights) & set(expected)
            if weights[name].shape != expected[name].shape
        )
        if missing or unexpected or wrong_shape:
            raise CheckpointError(
                f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                f"wrong shape {wrong_shape[:5]}; resume with the model the checkpoint was trained from"
            )

    def _load_optimizer_and_rng(
        self, optimizer_state: dict, rng_state: torch.Tensor, scheduler_state: dict | None, source: str
    ) -> None:
        if scheduler_state is not None and not isinstance(scheduler_state.get("last_epoch"), int):
            raise CheckpointError(f"{source}: the learning-rate schedule state has no step count")
        try:
            # Validates the parameter groups before changing anything.
            self.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, RuntimeError) as error:
            raise CheckpointError(f"{source}: optimizer state does not fit this model: {error}") from error
        if scheduler_state is not None:
            # The step count and base rates; the optimizer's groups already hold the current rate.
            self.scheduler.load_state_dict(scheduler_state)
        self.generator.set_state(rng_state)


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without later names of tensors that share memory with an earlier one."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    untied = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            untied[name] = tensor
    return untied


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(temporary path)``, then rename it to ``path``: a reader never sees a partial file."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)
