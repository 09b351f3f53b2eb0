"""Unmerged LoRA in the torch engine's runner (``AdapterStack``): rows of one batch on different adapter
versions give each version's merged model's logits, in prefill and in decode."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.errors import EngineError
from rollflow.inference.engine.adapter_stack import AdapterStack
from rollflow.inference.engine.model_runner import ModelRunner
from rollflow.models.loading import load_causal_lm

from .helpers.adapters import RANK, random_adapter

PROMPTS = [[5, 17, 42, 99, 3], [300, 2, 2, 7], [1000, 64, 8, 128, 11, 12], [9, 8, 7]]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).eval()


def merged(model, adapter: dict[str, torch.Tensor]):
    """The model with ``W + B @ A`` in every adapted module (the head untied from the embeddings)."""
    model = copy.deepcopy(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.lora_A.weight" in adapter:
                a, b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
                module.weight += b @ a
    return model


def first_logits_and_step(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        logits = runner.prefill(list(range(len(PROMPTS))), PROMPTS)
        next_tokens = logits.argmax(-1).tolist()
        step = runner.decode(next_tokens, [len(p) for p in PROMPTS])
    return logits, step


def test_rows_on_different_versions_match_each_versions_merged_model(base_model):
    adapters = [random_adapter(base_model, seed) for seed in (1, 2, 3)]
    runner = ModelRunner(copy.deepcopy(base_model), max_batch_size=4, max_model_len=64)
    runner.adapter_stack = AdapterStack(runner.model, capacity=4)
    for slot, adapter in enumerate(adapters, start=1):
        runner.adapter_stack.put(slot, adapter)
    runner.adapter_rows = torch.tensor([1, 2, 3, 0])  # the last row on the base
    logits, step = first_logits_and_step(runner)

    for row, adapter in enumerate([*adapters, None]):
        model = base_model if adapter is None else merged(base_model, adapter)
        reference = ModelRunner(model, max_batch_size=4, max_model_len=64)
        ref_logits, _ = first_logits_and_step(reference)
        torch.testing.assert_close(logits[row], ref_logits[row], atol=1e-4, rtol=1e-4)
        with torch.inference_mode():  # decode the same token the stacked runner fed this row
            reference.prefill(list(range(len(PROMPTS))), PROMPTS)
            ref_step = reference.decode(logits.argmax(-1).tolist(), [len(p) for p in PROMPTS])
        torch.testing.assert_close(step[row], ref_step[row], atol=1e-4, rtol=1e-4)
    # The versions really differ: a stack that ignored the rows would not pass the checks above.
    assert (logits[0] - logits[1]).abs().max() > 0.1


def test_one_slot_for_every_row_is_the_same_as_a_tensor_of_it(base_model):
    runner = ModelRunner(copy.deepcopy(base_model), max_batch_size=4, max_model_len=64)
    runner.adapter_stack = AdapterStack(runner.model, capacity=2)
    runner.adapter_stack.put(1, random_adapter(base_model, 5))
    runner.adapter_rows = 1
    logits, _ = first_logits_and_step(runner)
    runner.adapter_rows = torch.ones(len(PROMPTS), dtype=torch.long)
    again, _ = first_logits_and_step(runner)
    torch.testing.assert_close(logits, again, atol=1e-5, rtol=1e-5)


def test_an_adapter_that_does_not_fit_is_refused_naming_the_module(base_model):
    stack = AdapterStack(base_model, capacity=2)
    adapter = random_adapter(base_model, 1)
    adapter["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(RANK, 3)
    with pytest.raises(EngineError, match="model.layers.0.self_attn.q_proj"):
        stack.put(1, adapter)
    with pytest.raises(EngineError, match="cannot adapt: model.layers.9.mlp.up_proj"):
        stack.put(1, {"model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(1, 1)})
    with pytest.raises(ValueError, match="capacity >= 2"):
        AdapterStack(base_model, capacity=1)
