"""LoRA (``[trainer.lora]``) against full fine-tuning, each figure with its full-weight baseline in the same run.

Three parts (``--parts``, default all):

- ``learning``: the README's ``rollflow run examples/quickstart.toml`` as a subprocess, full fine-tuning
  (``trainer.lr = 1e-3``, the quickstart's) and then LoRA at each ``--lora`` ``rank:lr``, per schedule
  (``--schedules``). One line per run: the first step whose last 10 steps average a reward >= 0.9 (the
  quickstart's learning bar; null when never), the last 10 steps' mean, the engine-vs-trainer logprob mismatch
  over the steps sampled by the weights being trained (target < 1e-4), and the wall time. The targets
  (``--targets``) include ``lm_head``: on the random-init tiny model adapters on the projections alone cannot
  move the near-uniform output (``examples/quickstart_lora.toml``, ``tests/test_lora_learning.py``); the
  default ``8:3e-3`` is that file's recipe (at 1e-2 the head's adapter collapses the output before the
  policy reads the prompt).
- ``weights``: one weight update of a ~100M-parameter random-init Qwen3 (``_models.QWEN3_100M``; the tiny
  model's tokenizer size does not matter here), full against adapter-only, after one training step: the bytes every
  strategy sends (the named weights, float32) and the time of an in-process update (``TorchEngine
  .load_weights``: the adapter merged onto the engine's unmerged base, or the full copy), median of
  ``--repeats``.
- ``memory``: the trainer's peak memory in one training step of the same model (8 samples of 256 tokens, AdamW),
  full against LoRA, each in a fresh process after a warm-up step: ``VmHWM`` after the step minus ``VmRSS``
  before it (``benchmarks/trainer_memory.py`` explains the method), and the resident set after the step.

    python benchmarks/lora.py [--parts learning weights memory] [--schedules sync fully_async]
        [--lora 8:3e-3 16:1e-3] [--steps 200] [--targets q_proj,...,lm_head]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _models import QWEN3_100M

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BAR = 0.9
WINDOW = 10
LORA_RANK = 8


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


# ---------------------------------------------------------------- learning


def steps_to_bar(rewards: list[float]) -> int | None:
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW : end]) >= BAR:
            return end
    return None


def learning(schedules: list[str], loras: list[tuple[int, float]], steps: int, targets: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _quickstart import run_quickstart

    for schedule in schedules:
        baseline: dict[str, Any] | None = None
        for rank, lr in [(0, 1e-3), *loras]:
            overrides = [f"orchestrator.mode='{schedule}'", f"orchestrator.steps={steps}", f"trainer.lr={lr}"]
            if rank:
                overrides += [
                    f"trainer.lora.rank={rank}",
                    f"trainer.lora.alpha={2 * rank}",
                    f"trainer.lora.target_modules={json.dumps(targets)}",
                ]
            label = "full" if not rank else f"lora_r{rank}"
            with tempfile.TemporaryDirectory() as directory:
                metrics, elapsed = run_quickstart(Path(directory), overrides, f"{schedule} {label}")
            rewards = [m["reward_mean"] for m in metrics]
            mismatch = [
                m["logprob_mismatch"] for m in metrics if math.isfinite(m.get("logprob_mismatch", math.nan))
            ]
            line = {
                "benchmark": "lora",
                "figure": "quickstart_learning",
                "schedule": schedule,
                "variant": label,
                "lr": lr,
                "rank": rank or None,
                "target_modules": targets if rank else None,
                "steps": len(rewards),
                "steps_to_bar": steps_to_bar(rewards),
                "last10_reward": statistics.fmean(rewards[-WINDOW:]),
                "first5_reward": statistics.fmean(rewards[:5]),
                "logprob_mismatch_max": max(mismatch, default=math.nan),
                # Steps with on-policy tokens (sampled by the weights trained): in fully_async only the first.
                "logprob_mismatch_steps": len(mismatch),
                "wall_s": elapsed,
            }
            if baseline is None:
                baseline = line
            else:
                line["baseline"] = "full"
                line["baseline_steps_to_bar"] = baseline["steps_to_bar"]
                line["baseline_last10_reward"] = baseline["last10_reward"]
            emit(line)


# ---------------------------------------------------------------- weights and memory


def build_model() -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**QWEN3_100M)).eval()


def train_batch(model: Any, samples: int, tokens: int, seed: int) -> Any:
    """One packed step of random prompts and completions with their exact behaviour logprobs."""
    import random

    import torch

    from rollflow.config import TrainerConfig
    from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch
    from rollflow.orchestrator.packing import pack_for_trainer

    rng = random.Random(seed)
    vocab = QWEN3_100M["vocab_size"]
    group = []
    for index in range(samples):
        prompt = [rng.randrange(vocab) for _ in range(16)]
        completion = [rng.randrange(vocab) for _ in range(tokens - 16)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        group.append(
            Sample(
                prompt_index=0,
                sample_index=index,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=[logp[len(prompt) + j - 1, t].item() for j, t in enumerate(completion)],
                policy_versions=[0] * len(completion),
                finish_reason=FinishReason.STOP,
                reward=float(index % 2),
            )
        )
    batch = TrainBatch(step=0, groups=[ScoredGroup(prompt_index=0, samples=group)])
    return pack_for_trainer(batch, TrainerConfig(micro_batch_size=samples), 1)


def trainer_for(model: Any, lora: bool) -> Any:
    from rollflow.config import LoraConfig, TrainerConfig
    from rollflow.train.trainer import Trainer

    config = TrainerConfig(
        lr=1e-4,
        micro_batch_size=8,
        lora=LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK) if lora else None,
    )
    return Trainer(model, config, pad_token_id=0)


def weights(repeats: int) -> None:
    import copy

    import anyio

    from rollflow.inference.engine.engine import TorchEngine

    base = build_model()
    params = sum(p.numel() for p in base.parameters())
    results: dict[str, dict[str, Any]] = {}
    for variant in ("full", "lora"):
        trainer = trainer_for(copy.deepcopy(base), lora=variant == "lora")
        trainer.train_step(train_batch(base, samples=2, tokens=64, seed=1))
        engine = TorchEngine(copy.deepcopy(base), max_batch_size=1, max_model_len=64)
        named = [(name, tensor.detach().clone()) for name, tensor in trainer.named_weights()]
        sent = sum(t.numel() * t.element_size() for _, t in named)

        async def update(version: int, engine: Any = engine, named: list = named) -> None:
            await engine.load_weights(named, policy_version=version)

        times = []
        for version in range(1, repeats + 1):
            started = time.perf_counter()
            anyio.run(update, version)
            times.append(time.perf_counter() - started)
        anyio.run(engine.shutdown)
        results[variant] = {
            "bytes_per_update": sent,
            "update_s": statistics.median(times),
            "tensors": len(named),
        }
    for variant, figures in results.items():
        line = {
            "benchmark": "lora",
            "figure": "weight_update",
            "variant": variant,
            "model": "qwen3-100m (random init)",
            "parameters": params,
            "lora_rank": LORA_RANK if variant == "lora" else None,
            **figures,
            "update_how": "in-process TorchEngine.load_weights (lora: merged onto the unmerged base)",
            "repeats": repeats,
        }
        if variant != "full":
            line["baseline"] = "full"
            line["baseline_bytes_per_update"] = results["full"]["bytes_per_update"]
            line["baseline_update_s"] = results["full"]["update_s"]
            line["bytes_ratio"] = figures["bytes_per_update"] / results["full"]["bytes_per_update"]
        emit(line)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_memory(variant: str, samples: int, tokens: int) -> dict[str, Any]:
    """In this (fresh) process: a warm-up step, then the measured one."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build_model()
    batch = train_batch(model, samples=samples, tokens=tokens, seed=2)
    warm = train_batch(model, samples=2, tokens=32, seed=1)
    trainer = trainer_for(model, lora=variant == "lora")
    trainer.train_step(warm)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status_bytes("VmRSS")
    started = time.perf_counter()
    result = trainer.train_step(batch)
    seconds = time.perf_counter() - started
    assert result.updated
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {
        "peak_step_bytes": _status_bytes("VmHWM") - before,
        "rss_after_step_bytes": _status_bytes("VmRSS"),
        "step_s": seconds,
        "trainable_parameters": trainable,
    }


def memory(samples: int, tokens: int) -> None:
    results = {}
    for variant in ("full", "lora"):
        output = subprocess.run(
            [
                sys.executable,
                __file__,
                "--measure-memory",
                variant,
                "--samples",
                str(samples),
                "--tokens",
                str(tokens),
            ],
            capture_output=True,
            text=True,
        )
        if output.returncode != 0:
            raise SystemExit(f"memory {variant} failed:\n{output.stderr[-3000:]}")
        results[variant] = json.loads(output.stdout.strip().splitlines()[-1])
    for variant, figures in results.items():
        line = {
            "benchmark": "lora",
            "figure": "trainer_memory",
            "variant": variant,
            "model": "qwen3-100m (random init)",
            "batch": samples,
            "tokens_per_sample": tokens,
            **figures,
        }
        if variant != "full":
            line["baseline"] = "full"
            for key in ("peak_step_bytes", "rss_after_step_bytes", "step_s"):
                line[f"baseline_{key}"] = results["full"][key]
        emit(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["learning", "weights", "memory"])
    parser.add_argument("--schedules", nargs="+", default=["sync", "fully_async"])
    parser.add_argument("--lora", nargs="+", default=["8:3e-3"], help="rank:lr of each LoRA run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
        help="trainer.lora.target_modules of the learning runs",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--measure-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_memory:
        print(json.dumps(measure_memory(args.measure_memory, args.samples, args.tokens)))
        return
    loras = [(int(rank), float(lr)) for rank, lr in (item.split(":") for item in args.lora)]
    if "learning" in args.parts:
        learning(args.schedules, loras, args.steps, args.targets.split(","))
    if "weights" in args.parts:
        weights(args.repeats)
    if "memory" in args.parts:
        memory(args.samples, args.tokens)


if __name__ == "__main__":
    main()
