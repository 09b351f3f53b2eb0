"""LoRA adapters in the wire view (``{module}.lora_A.weight``, ``{module}.lora_B.weight``) for engine tests."""

from __future__ import annotations

import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4


def random_adapter(model, seed: int) -> dict[str, torch.Tensor]:
    """Wire-view adapter tensors on every projection and the head, large enough to change the logits."""
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name == "lm_head" or name.rsplit(".", 1)[-1] in MODULES):
            a = torch.randn(RANK, module.in_features, generator=generator) * 0.3
            b = torch.randn(module.out_features, RANK, generator=generator) * 0.3
            adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"] = a, b
    return adapter
