"""LoRA adapters on the trainer's model (``[trainer.lora]``), built with ``peft``.

The adapter is injected into the Hugging Face model in place (``peft.inject_adapter_in_model``), so the model
keeps its class, its ``forward`` and everything the trainer reads of it (``get_output_embeddings``, the
decoder layers FSDP2 shards, gradient checkpointing). Each targeted ``Linear`` becomes a ``peft`` LoRA layer
holding the frozen base weight (``<module>.base_layer.weight``) and the adapter (``<module>.lora_A.default
.weight``, ``<module>.lora_B.default.weight``); only the adapter requires gradients, so the optimizer holds
state for it alone.

Three views of the adapter:
- **wire** (``adapter_weights``): what weight updates send, ``<module>.lora_A.weight`` ``[r, in]`` and
  ``<module>.lora_B.weight`` ``[out, r]`` with ``B`` already multiplied by the scaling (``alpha / rank``), so
  an engine merges ``W = W_base + B @ A`` with no configuration of its own (``rollflow.inference.engine
  .adapters``).
- **PEFT** (``peft_state_dict``): ``base_model.model.<module>.lora_A.weight`` unscaled, with
  ``adapter_config.json``: the directory ``PeftModel.from_pretrained`` loads (checkpoints, ``rollflow export``).
- **training**: the parameters themselves.

The KL reference is the same model with the adapter switched off (``adapter_disabled``): no second copy.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflow.errors import ConfigError

if TYPE_CHECKING:
    from rollflow.config import LoraConfig

#: Files of a PEFT adapter directory.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."


def _missing_peft() -> ConfigError:
    return ConfigError(
        "trainer.lora needs the peft package, which is not installed: pip install 'rollflow[lora]'"
    )


def _linear_names(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every ``Linear`` that may take an adapter, the output embeddings (``lm_head``) included: an adapter
    there changes the logits alone, even when the head is tied to the input embeddings (the engine and a
    merged export then give the head a weight of its own)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def resolve_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """The full names of the ``Linear`` modules ``lora.target_modules`` selects, in model order.

    Raises:
        ConfigError: an entry that matches no ``Linear`` (naming ``trainer.lora.target_modules`` and a few
            names it could match), or a ``rank`` larger than a targeted layer's smaller size.
    """
    linears = _linear_names(model)
    chosen: set[str] = set()
    for pattern in lora.target_modules:
        matched = {name for name in linears if name == pattern or name.endswith("." + pattern)}
        if not matched:
            try:
                regex = re.compile(pattern)
            except re.error as error:
                raise ConfigError(
                    f"trainer.lora.target_modules entry {pattern!r} matches no module name and is not a "
                    f"regular expression ({error})"
                ) from None
            matched = {name for name in linears if regex.fullmatch(name)}
        if pattern != "lm_head":  # only an entry that names it takes the head, never a suffix or pattern
            matched.discard("lm_head")
        if not matched:
            suffixes = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ConfigError(
                f"trainer.lora.target_modules entry {pattern!r} matches no Linear module of the model; its "
                f"Linear modules end with {', '.join(suffixes[:12])} (e.g. {next(iter(linears), '')!r})"
            )
        chosen |= matched
    too_small = [
        f"{name} [{linears[name].out_features}, {linears[name].in_features}]"
        for name in sorted(chosen)
        if lora.rank > min(linears[name].in_features, linears[name].out_features)
    ]
    if too_small:
        raise ConfigError(
            f"trainer.lora.rank = {lora.rank} is larger than the smaller size of targeted layers "
            f"{', '.join(too_small[:5])}: a rank above it adds parameters and nothing else; lower "
            "trainer.lora.rank or leave those modules out of trainer.lora.target_modules"
        )
    return [name for name in linears if name in chosen]


def peft_config(lora: LoraConfig, targets: list[str]) -> Any:
    """The ``peft.LoraConfig`` for these exact module names."""
    try:
        import peft
    except ImportError:
        raise _missing_peft() from None
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # Exact full names: peft matches list entries as name suffixes, and a full name is its own suffix.
        target_modules=targets,
        init_lora_weights=True if lora.init == "default" else "gaussian",
        bias="none",
    )


def has_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a LoRA adapter already (``apply_lora`` ran on it)."""
    return any(name.endswith(f"lora_A.{_ADAPTER}.weight") for name, _ in model.named_parameters())


def apply_lora(model: torch.nn.Module, lora: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Inject the adapter into ``model`` in place and return it: the base frozen, the adapter float32.

    The adapter's initial values come from a generator seeded with ``seed`` (global RNG state is left
    alone), so every data-parallel rank, a trainer process and a single trainer start from the same adapter.
    Works on a model on the meta device (a sharded rank's template) too.

    Raises:
        ConfigError: as ``resolve_targets``, or peft is not installed.
    """
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise _missing_peft() from None
    if has_adapter(model):
        return model
    targets = resolve_targets(model, lora)
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # CPU RNG only: the adapter is initialised on the CPU or meta
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(lora, targets), model, adapter_name=_ADAPTER)
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            parameter.data = parameter.data.float()
            parameter.requires_grad_(True)
    return model


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Forwards inside run the base model alone (the adapter's layers pass their base layer's output)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
            # enable_adapters(True) marks the adapter trainable again; so it is, and only it.


def _adapter_modules(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and _ADAPTER in module.lora_A:
            yield name, module


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The wire view: ``(<module>.lora_A.weight, A)`` and ``(<module>.lora_B.weight, scaling * B)`` of
    every adapted module, detached. Under FSDP2 they are DTensors (the scaling is a local op on each shard)."""
    for name, module in _adapter_modules(model):
        scaling = float(module.scaling[_ADAPTER])
        yield f"{name}.lora_A.weight", module.lora_A[_ADAPTER].weight.detach()
        yield f"{name}.lora_B.weight", module.lora_B[_ADAPTER].weight.detach() * scaling


def peft_state_dict(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's file names for the adapter parameters of a (full) model state dict ``named``."""
    marker = f".{_ADAPTER}.weight"
    return {
        _PEFT_PREFIX + name.replace(marker, ".weight"): tensor
        for name, tensor in named.items()
        if ".lora_A." in name or ".lora_B." in name
    }


def training_state_dict(peft_named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``peft_state_dict``: the model's own parameter names."""
    return {
        name.removeprefix(_PEFT_PREFIX).replace(".weight", f".{_ADAPTER}.weight"): tensor
        for name, tensor in peft_named.items()
    }


def adapter_config_json(lora: LoraConfig, targets: list[str], base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT adapter directory for these targets."""
    config = peft_config(lora, targets).to_dict()
    config["base_model_name_or_path"] = base_model
    config["task_type"] = "CAUSAL_LM"
    for key, value in list(config.items()):
        if isinstance(value, set):
            config[key] = sorted(value)
    return config


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the modules holding an adapter, in model order."""
    return [name for name, _ in _adapter_modules(model)]


def write_adapter_dir(directory: Path, peft_named: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """A PEFT adapter directory: ``adapter_model.safetensors`` and ``adapter_config.json``, each written
    under a temporary name and renamed into place."""
    from safetensors.torch import save_file

    from rollflow.train.checkpoint_io import write_atomically

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in peft_named.items()}
    write_atomically(
        directory / ADAPTER_WEIGHTS_FILE, lambda path: save_file(tensors, path, metadata={"format": "pt"})
    )
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    write_atomically(directory / ADAPTER_CONFIG_FILE, lambda path: path.write_text(text))


def check_lora_targets(lora: LoraConfig, model_dir: Path) -> None:
    """``resolve_targets`` on the model at ``model_dir`` built on the meta device (no weights read, no
    memory): the run's ``trainer.lora`` errors before any process starts.

    Raises:
        ConfigError: as ``resolve_targets``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    resolve_targets(model, lora)
