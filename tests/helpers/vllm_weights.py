"""Weights to push into the test vLLM server, and what they should make it answer: a seeded perturbation of
the tiny model's own weights, transformers' logprobs on them (fp32), and the weight barrier's sequence around
one push (pause, push, resume)."""

from __future__ import annotations

from pathlib import Path

import torch

from rollflow.weights import StaticWeights, WeightTransfer

# fp32 on both sides; what differs is the order of the kernels' sums.
LOGPROB_TOLERANCE = 1e-4


def model_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The model's own HF state dict."""
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).items())


def perturbed_weights(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The model's HF state dict, each floating tensor moved by seeded noise (so a push visibly changes the
    logprobs)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            name,
            tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            if tensor.is_floating_point()
            else tensor,
        )
        for name, tensor in model_weights(model_dir)
    ]


def reference_logprobs(model_dir: Path, weights, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' log p(token) of each ``completion`` token after ``prompt``, on ``weights``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False)
    model.eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [float(logprobs[i, token]) for i, token in enumerate(completion)]


async def push(client, transfer: WeightTransfer, weights, policy_version: int) -> None:
    """Pause, push ``weights`` as ``policy_version`` through ``transfer``, resume (the barrier's sequence)."""
    await client.control.pause("abort")
    try:
        await transfer.push(client.control, StaticWeights(lambda: weights), policy_version=policy_version)
    finally:
        await client.control.resume()
