"""Trainer step time with shared prompts (``trainer.share_prompts``) against the rows run one by one.

One ``Trainer.train_step`` (forward, backward, AdamW) of the local tiny model on a GRPO batch: ``--groups``
prompts of ``--prompt-tokens`` random tokens, ``--samples`` completions of ``--completion-tokens`` each, with
the behaviour logprobs the trainer's own weights give (so every step trains). Shapes: ``race`` is the peer
race's (``benchmarks/peer_trl.py``: 16 x 8 samples, ~17-token prompts, 8 new tokens), ``long_prompt`` a
prompt 8x its completions. Both variants train copies of the same weights on the same batch, alternated step
by step after a warm-up, so the machine's noise falls on both; the figure is the median step of each and
their ratio. Each also reports its first update's gradient norm: the two must agree.

Prints one JSON line per shape:
{"benchmark": "shared_prompts", "shape": "race", "batch": 128, "prompt_tokens": 17, "completion_tokens": 8,
 "step_s": ..., "baseline": "rows", "baseline_step_s": ..., "ratio": ..., "grad_norm": ..., "baseline_grad_norm": ...}

Usage: ``python benchmarks/shared_prompts.py [--steps 30] [--shapes race,long_prompt]`` (~1 minute on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {
    "race": {"groups": 16, "samples": 8, "prompt_tokens": 17, "completion_tokens": 8},
    "long_prompt": {"groups": 4, "samples": 8, "prompt_tokens": 256, "completion_tokens": 32},
}


def _batch(model, shape: dict[str, int], seed: int):
    import torch

    from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    groups = []
    for index in range(shape["groups"]):
        prompt = [rng.randrange(3, vocab) for _ in range(shape["prompt_tokens"])]
        samples = []
        for sample_index in range(shape["samples"]):
            completion = [rng.randrange(3, vocab) for _ in range(shape["completion_tokens"])]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            logprobs = [logp[len(prompt) + j - 1, t].item() for j, t in enumerate(completion)]
            samples.append(
                Sample(
                    prompt_index=index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    logprobs=logprobs,
                    policy_versions=[0] * len(completion),
                    finish_reason=FinishReason.LENGTH,
                    reward=rng.random(),
                )
            )
        groups.append(ScoredGroup(prompt_index=index, samples=samples))
    return TrainBatch(step=0, groups=groups)


def measure(shape_name: str, steps: int) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.config import TrainerConfig
    from rollflow.models.tiny import ensure_tiny_model
    from rollflow.orchestrator.packing import pack_for_trainer
    from rollflow.train.trainer import Trainer

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    batch = _batch(model, shape, seed=0)
    trainers, times, grad_norms = {}, {"shared": [], "rows": []}, {}
    for variant in ("shared", "rows"):
        config = TrainerConfig(share_prompts=variant == "shared", micro_batch_size=1024)
        trainers[variant] = Trainer(copy.deepcopy(model), config, pad_token_id=model.config.pad_token_id)
    packed = pack_for_trainer(batch, trainers["rows"].config, 1)
    for step in range(steps + 3):
        for variant, trainer in trainers.items():
            started = time.perf_counter()
            result = trainer.train_step(packed)
            elapsed = time.perf_counter() - started
            if step == 0:
                grad_norms[variant] = result.metrics["grad_norm"]
            if step >= 3:  # warm-up: allocator, optimizer state
                times[variant].append(elapsed)
    step_s, baseline_s = statistics.median(times["shared"]), statistics.median(times["rows"])
    return {
        "benchmark": "shared_prompts",
        "shape": shape_name,
        "batch": shape["groups"] * shape["samples"],
        "prompt_tokens": shape["prompt_tokens"],
        "completion_tokens": shape["completion_tokens"],
        "shared": trainers["shared"].share_prompts,
        "step_s": round(step_s, 4),
        "baseline": "rows",
        "baseline_step_s": round(baseline_s, 4),
        "ratio": round(step_s / baseline_s, 3),
        "grad_norm": grad_norms["shared"],
        "baseline_grad_norm": grad_norms["rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each variant (default 30)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    names = [name for name in args.shapes.split(",") if name]
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        parser.error(f"--shapes {args.shapes!r}: pick from {', '.join(SHAPES)}")
    for name in names:
        print(json.dumps(measure(name, args.steps)), flush=True)


if __name__ == "__main__":
    main()
