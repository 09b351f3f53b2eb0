"""Merged against unmerged LoRA serving in the torch engine, each figure beside the merged baseline, same run.

- ``decode_step_ms``: one decode step of ``--batch`` rows (``ModelRunner.decode``, median of ``--repeats``
  rounds of ``--steps`` steps, the variants taking turns) with the adapter merged into the weights (the baseline: the base model's
  speed), unmerged with every row on one version (``AdapterStack``, one pair of low-rank matmuls per fused
  projection), and unmerged with the rows spread over ``--versions`` versions (a gathered batched matmul).
- ``update_ms``: one adapter push into an engine's runner: the merge (``W_base + B @ A`` per module and a
  refresh of the fused weights) against writing the adapter into a stack slot.

Models: ``rollflow:tiny`` and a random-init Qwen3 of ~100M parameters (``benchmarks/_models.py``), LoRA rank
``--rank`` on the seven projections and ``lm_head``.

    python benchmarks/lora_serving.py [--models tiny 100m] [--batch 8] [--steps 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any

from _models import QWEN3_100M

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def load_model(name: str) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name == "tiny":
        from rollflow.models.loading import load_causal_lm
        from rollflow.models.tiny import ensure_tiny_model

        return load_causal_lm(ensure_tiny_model()).eval()
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**QWEN3_100M)).eval()


def adapter_of(model: Any, rank: int, seed: int) -> dict[str, Any]:
    """Wire-view adapter tensors (B scaled) on the projections and the head."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name == "lm_head" or name.rsplit(".", 1)[-1] in MODULES):
            adapter[f"{name}.lora_A.weight"] = (
                torch.randn(rank, module.in_features, generator=generator) * 0.02
            )
            adapter[f"{name}.lora_B.weight"] = (
                torch.randn(module.out_features, rank, generator=generator) * 0.02
            )
    return adapter


def merge_into(model: Any, adapter: dict[str, Any]) -> None:
    """What the merged path does to the weights (``adapters.AdapterMerge``), untying the head."""
    import torch

    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.lora_A.weight" in adapter:
                base = module.weight.float()
                b, a = adapter[f"{name}.lora_B.weight"], adapter[f"{name}.lora_A.weight"]
                module.weight.copy_(torch.addmm(base, b, a))


def decode_round_ms(runner: Any, batch: int, steps: int) -> float:
    """Mean decode-step time (ms) over ``steps`` steps after a prefill of ``batch`` prompts."""
    import torch

    prompts = [[(7 * row + i) % 500 + 10 for i in range(16)] for row in range(batch)]
    with torch.inference_mode():
        runner.prefill(list(range(batch)), prompts)
        started = time.perf_counter()
        for step in range(steps):
            runner.decode([11] * batch, [16 + step] * batch)
    return (time.perf_counter() - started) / steps * 1e3


def measure(name: str, batch: int, steps: int, repeats: int, rank: int, versions: int) -> None:
    import torch

    from rollflow.inference.engine.adapter_stack import AdapterStack
    from rollflow.inference.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    base = load_model(name)
    adapters = [adapter_of(base, rank, seed) for seed in range(versions)]
    merged_model = copy.deepcopy(base)
    merge_into(merged_model, adapters[0])
    max_len = 16 + steps + 1
    merged = ModelRunner(merged_model, max_batch_size=batch, max_model_len=max_len)
    unmerged = ModelRunner(copy.deepcopy(base), max_batch_size=batch, max_model_len=max_len)
    unmerged.adapter_stack = AdapterStack(unmerged.model, versions + 1)
    for slot, adapter in enumerate(adapters, start=1):
        unmerged.adapter_stack.put(slot, adapter)
    common = {"benchmark": "lora_serving", "model": name, "rank": rank, "batch": batch}

    # Variants take turns round by round, so the machine's load shifts every one alike; round 0 warms up.
    mixed_rows = torch.tensor([1 + row % versions for row in range(batch)])
    variants = {"merged": (merged, 0), "unmerged_1_version": (unmerged, 1)}
    variants[f"unmerged_{versions}_versions"] = (unmerged, mixed_rows)
    rounds: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(repeats + 1):
        for variant, (runner, rows) in variants.items():
            runner.adapter_rows = rows
            rounds[variant].append(decode_round_ms(runner, batch, steps))
    times = {variant: statistics.median(values[1:]) for variant, values in rounds.items()}
    baseline = times.pop("merged")
    emit({**common, "figure": "decode_step_ms", "variant": "merged", "value": baseline, "unit": "ms"})
    for variant, value in times.items():
        emit(
            {
                **common,
                "figure": "decode_step_ms",
                "variant": variant,
                "value": value,
                "unit": "ms",
                "baseline": "merged",
                "baseline_value": baseline,
                "ratio": value / baseline,
            }
        )

    merge_times, put_times = [], []
    for repeat in range(repeats):
        adapter = adapters[repeat % versions]
        target = copy.deepcopy(base)
        runner = ModelRunner(target, max_batch_size=1, max_model_len=8)
        started = time.perf_counter()
        merge_into(target, adapter)
        runner.refresh_weights()
        merge_times.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        unmerged.adapter_stack.put(1 + repeat % versions, adapter)
        put_times.append((time.perf_counter() - started) * 1e3)
    merge_ms, put_ms = statistics.median(merge_times), statistics.median(put_times)
    emit({**common, "figure": "update_ms", "variant": "merged", "value": merge_ms, "unit": "ms"})
    emit(
        {
            **common,
            "figure": "update_ms",
            "variant": "unmerged",
            "value": put_ms,
            "unit": "ms",
            "baseline": "merged",
            "baseline_value": merge_ms,
            "ratio": put_ms / merge_ms,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=["tiny", "100m"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--versions", type=int, default=3)
    args = parser.parse_args()
    for name in args.models:
        measure(name, args.batch, args.steps, args.repeats, args.rank, args.versions)


if __name__ == "__main__":
    main()
