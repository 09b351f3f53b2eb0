"""Data-parallel parity: one step of ``--workers`` trainer workers against one trainer, on the same batch.

Both start from the tiny model's weights and train one step on the same scored groups (random prompts and
completions of uneven lengths, behaviour logprobs from the model, so the ratio starts at 1). The single
trainer is the baseline, measured in the same run; the workers train the batch packed for their ranks
(token-balanced, uneven lengths per rank). For each ``--parallelism`` it prints one JSON line with the
absolute differences of the loss and the gradient norm (issue bar: 1e-5) and the largest weight difference
after the step (bar: 1e-4), with the baseline's values and the workers' step time.

    python benchmarks/trainer_parity.py [--workers 2] [--parallelism fsdp2 ddp] [--lr 1e-3] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

import torch

from rollflow.config import TrainerConfig
from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch
from rollflow.models.loading import load_causal_lm
from rollflow.models.tiny import ensure_tiny_model
from rollflow.orchestrator.packing import pack_for_trainer, sample_length
from rollflow.train.process import TrainerSpec
from rollflow.train.trainer import Trainer
from rollflow.train.workers import TrainerWorkers


@torch.no_grad()
def scored_batch(model, seed: int, groups: int = 4, group_size: int = 4) -> TrainBatch:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    scored = []
    for index in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        samples = []
        for sample_index in range(group_size):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
            logp = torch.log_softmax(
                model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1
            )
            samples.append(
                Sample(
                    prompt_index=index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    logprobs=[logp[len(prompt) + j - 1, t].item() for j, t in enumerate(completion)],
                    policy_versions=[0] * len(completion),
                    finish_reason=FinishReason.STOP,
                    reward=rng.random(),
                )
            )
        scored.append(ScoredGroup(prompt_index=index, samples=samples))
    return TrainBatch(step=1, groups=scored)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--parallelism", nargs="+", default=["fsdp2", "ddp"], choices=["fsdp2", "ddp"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch-size", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir = ensure_tiny_model()
    base = load_causal_lm(model_dir)
    batch = scored_batch(base, args.seed)
    for parallelism in args.parallelism:
        config = TrainerConfig(
            lr=args.lr,
            micro_batch_size=args.micro_batch_size,
            num_workers=args.workers,
            parallelism=parallelism,
        )
        spec = TrainerSpec(
            model_dir=model_dir, config=config, temperature=1.0, pad_token_id=0, seed=0, off_policy="none"
        )
        single = Trainer(copy.deepcopy(base), **spec.trainer_kwargs())
        started = time.perf_counter()
        baseline = single.train_step(pack_for_trainer(batch, config, 1), policy_version=0)
        single_s = time.perf_counter() - started
        workers = TrainerWorkers(spec)
        try:
            packed = pack_for_trainer(batch, config, args.workers)
            started = time.perf_counter()
            result = workers.train_step(packed, policy_version=0)
            workers_s = time.perf_counter() - started
            full = dict(workers.named_weights())
        finally:
            workers.close()
        weight_diff = max((full[name] - tensor).abs().max().item() for name, tensor in single.named_weights())
        print(
            json.dumps(
                {
                    "figure": "trainer_parity",
                    "parallelism": parallelism,
                    "workers": args.workers,
                    "backend": "gloo",
                    "dtype": "float32",
                    "lr": args.lr,
                    "rank_tokens": [sum(sample_length(s) for s in rank.samples) for rank in packed.ranks],
                    "micro_batches_per_rank": len(packed.ranks[0].micro_batches),
                    "loss_abs_diff": abs(result.metrics["loss"] - baseline.metrics["loss"]),
                    "grad_norm_abs_diff": abs(result.metrics["grad_norm"] - baseline.metrics["grad_norm"]),
                    "weights_max_abs_diff": weight_diff,
                    "baseline_loss": baseline.metrics["loss"],
                    "baseline_grad_norm": baseline.metrics["grad_norm"],
                    "baseline_step_s": round(single_s, 3),
                    "workers_step_s": round(workers_s, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
