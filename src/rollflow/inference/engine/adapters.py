"""LoRA adapters in the torch engine: merged into the weights it serves, over an unmerged copy of the base.

A weight update may carry adapter tensors instead of weights (``trainer.lora``; ``rollflow.train.lora``'s
wire view): ``<module>.lora_A.weight`` ``[r, in]`` and ``<module>.lora_B.weight`` ``[out, r]``, B already
scaled. The engine serves ``W = W_base + B @ A`` for each adapted module: the first adapter for a module keeps
a copy of its base weight, and every later version is merged onto that copy again (never onto the previous
merge, whose rounding would add up over a run). The engine's forward then runs on plain weights, at the
base model's speed, whatever the rank; the merge is one ``[out, r] @ [r, in]`` per module per update.

A full weight for an adapted module (a full push after adapter pushes) replaces its base copy: the module's
adapter is dropped with it. The adapter tensors are kept as they arrived, for ``/weight_checker`` (proof of
delivery, ``rollflow.weights.delivery``).
"""

from __future__ import annotations

import hashlib

import torch

from rollflow.errors import EngineError
from rollflow.weights.delivery import ADAPTER_SUFFIXES
from rollflow.weights.delivery import is_adapter_name as is_adapter_name

#: What adapter tensor names end with (after ``<module>``).
_A, _B = ADAPTER_SUFFIXES


class AdapterMerge:
    """The base copies and the adapter tensors of one engine's adapted modules."""

    def __init__(self) -> None:
        #: ``<module>.weight`` -> its unmerged base weight.
        self.base: dict[str, torch.Tensor] = {}
        #: Adapter tensor name -> the tensor as received (what ``checksums`` hashes).
        self.adapter: dict[str, torch.Tensor] = {}

    def merged(
        self,
        adapter: list[tuple[str, torch.Tensor]],
        state: dict[str, torch.Tensor],
        full: dict[str, torch.Tensor],
    ) -> list[tuple[str, torch.Tensor]]:
        """``(<module>.weight, W_base + B @ A)`` for every module ``adapter`` holds both halves of, in the
        serving dtype; ``full`` are the update's full weights (a new base for their modules). Changes nothing.

        Raises:
            EngineError: a module the model does not have, a half without the other, shapes that do not
                fit the module's weight, or a non-finite adapter tensor (the message names them).
        """
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in adapter:
            suffix = _A if name.endswith(_A) else _B
            halves.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
        problems = []
        for module, pair in halves.items():
            weight = state.get(f"{module}.weight")
            if weight is None:
                problems.append(f"{module}: the model has no {module}.weight")
            elif len(pair) != 2:
                problems.append(f"{module}: lora_A and lora_B come together, got only {sorted(pair)[0][1:]}")
            else:
                a, b = pair[_A], pair[_B]
                out_features, in_features = weight.shape
                if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape[0] != out_features:
                    problems.append(
                        f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its weight "
                        f"{tuple(weight.shape)} (A [r, {in_features}], B [{out_features}, r])"
                    )
                elif a.shape[0] != b.shape[1]:
                    problems.append(f"{module}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}")
                elif not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                    problems.append(f"{module}: the adapter holds inf or NaN")
        if problems:
            raise EngineError(f"load_weights got an adapter it cannot apply: {'; '.join(problems[:10])}")
        merged = []
        for module, pair in halves.items():
            key = f"{module}.weight"
            target = state[key]
            base = full.get(key, self.base.get(key, target))
            base = base.to(device=target.device, dtype=torch.float32)
            a = pair[_A].to(device=target.device, dtype=torch.float32)
            b = pair[_B].to(device=target.device, dtype=torch.float32)
            merged.append((key, torch.addmm(base, b, a).to(target.dtype)))
        return merged

    def commit(
        self,
        adapter: list[tuple[str, torch.Tensor]],
        state: dict[str, torch.Tensor],
        full: dict[str, torch.Tensor],
    ) -> None:
        """Record a load that went in: base copies for newly adapted modules (taken before the merged weights
        are copied over them), the adapter tensors; a full weight drops its module's base copy and adapter."""
        for key in full:
            if key in self.base:
                del self.base[key]
                module = key.removesuffix(".weight")
                self.adapter.pop(module + _A, None)
                self.adapter.pop(module + _B, None)
        for name, tensor in adapter:
            key = name.removesuffix(_A if name.endswith(_A) else _B) + ".weight"
            if key not in self.base:
                source = full.get(key, state[key])
                self.base[key] = source.detach().to(device=state[key].device, copy=True)
            self.adapter[name] = tensor.detach().clone()

    def checksums(self) -> dict[str, str]:
        """SHA-256 of each adapter tensor's bytes, as held: ``{name: hex}``."""
        return adapter_checksums(self.adapter)


def adapter_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes: ``{name: hex}``, by name."""
    return {
        name: hashlib.sha256(tensor.to("cpu").contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, tensor in sorted(tensors.items())
    }
