"""Peak memory of one training micro-batch: full logits against logprobs computed in chunks of positions.

One ``Trainer.train_step`` on 8 samples of 1,024 tokens each (one micro-batch: forward, backward, AdamW) of a
random-init Qwen3 with Qwen3's 151,936-token vocabulary and the tiny model's small layers (hidden size 64), so
the logits dominate memory as they do for a real model. Variants: ``trainer.logprob_chunk_tokens = 0`` (the
full ``[batch, time, vocab]`` logits, the baseline) and chunks of 1,024 and 256 positions.

How memory is measured: each variant runs in a fresh Python process (so no variant inherits another's freed
memory), after one warm-up step on a short batch (optimizer state allocated, allocator warmed). Just before the
measured step the process resets its peak resident set size (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0);
the figure is ``VmHWM`` after the step minus ``VmRSS`` before it: the most physical memory the step added at any
moment. torch's CPU allocator has no statistics of its own and ``tracemalloc`` does not see it; RSS sees every
page torch touches. glibc returns large blocks (> 32 MiB, every vocabulary-sized tensor here) to the system when
they are freed, so the high-water mark is a true peak; smaller blocks it may keep count against the chunked
variants (the figure is an upper bound for them).

Prints one JSON line per variant:
{"benchmark": "trainer_memory", "variant": "chunked_1024", "logprob_chunk_tokens": 1024, "batch": 8,
 "tokens_per_sample": 1024, "vocab_size": 151936, "peak_bytes": ..., "logits_bytes": ..., "peak_over_logits": ...,
 "step_seconds": ..., "baseline": "full_logits", "baseline_peak_bytes": ..., "reduction": ...}
``logits_bytes`` is the theoretical size of one float32 ``[batch, time, vocab]`` logits tensor.

Usage: ``python benchmarks/trainer_memory.py`` (Linux; up to a minute per variant on 2 CPU cores). The
baseline variant needs ~4x ``logits_bytes`` of free memory, ~20 GiB at 8 x 1,024 tokens: with less available,
it says so on stderr and measures every variant at the longest samples that fit (``tokens_per_sample`` in each
line says which). ``--variants chunked_1024,chunked_256`` measures without the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB_SIZE = 151_936  # Qwen3's
BATCH = 8
TOKENS_PER_SAMPLE = 1024
PROMPT_TOKENS = 8
VARIANTS = {"full_logits": 0, "chunked_1024": 1024, "chunked_256": 256}
ARCHITECTURE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


def _batch(step: int, tokens_per_sample: int):
    import random

    from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch

    rng = random.Random(step)
    samples = []
    for index in range(BATCH):
        completion = tokens_per_sample - PROMPT_TOKENS
        samples.append(
            Sample(
                prompt_index=0,
                sample_index=index,
                prompt_token_ids=[rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_TOKENS)],
                completion_token_ids=[rng.randrange(VOCAB_SIZE) for _ in range(completion)],
                logprobs=[-12.0] * completion,
                policy_versions=[0] * completion,
                finish_reason=FinishReason.LENGTH,
                reward=float(index % 2),
            )
        )
    return TrainBatch(step=step, groups=[ScoredGroup(prompt_index=0, samples=samples)])


def measure(chunk_tokens: int, tokens_per_sample: int) -> dict[str, float]:
    """Run in a fresh process: the step's peak added RSS and its duration."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rollflow.config import TrainerConfig
    from rollflow.orchestrator.packing import pack_for_trainer
    from rollflow.train.trainer import Trainer

    # On a shared machine a variant that runs out of memory should be the process the kernel ends.
    with open("/proc/self/oom_score_adj", "w") as oom_score_adj:
        oom_score_adj.write("1000")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCHITECTURE)).eval()
    config = TrainerConfig(micro_batch_size=BATCH, logprob_chunk_tokens=chunk_tokens, lr=1e-4)
    trainer = Trainer(model, config, pad_token_id=0)
    trainer.train_step(
        pack_for_trainer(_batch(0, tokens_per_sample=32), config)
    )  # warm-up: optimizer state, allocator
    batch = pack_for_trainer(_batch(1, tokens_per_sample), config)
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current RSS
    started = time.perf_counter()
    result = trainer.train_step(batch)
    seconds = time.perf_counter() - started
    assert result.updated, result.metrics
    return {"peak_bytes": _status_bytes("VmHWM") - before, "step_seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens-per-sample", type=int, default=TOKENS_PER_SAMPLE, help="sample length (default 1024)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all; the reduction needs full_logits)",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.tokens_per_sample)))
        return
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}

    tokens_per_sample = args.tokens_per_sample
    if "full_logits" in variants:
        # The full-logits step holds about four logits-sized tensors at its peak (logits, logsumexp's exp, and
        # their gradients in the backward); on a smaller machine, measure at the longest samples that fit.
        per_token = 4 * BATCH * VOCAB_SIZE * 4
        available = _meminfo_bytes("MemAvailable") - 2 * 2**30
        if per_token * tokens_per_sample > available:
            fits = max(available // per_token // 64 * 64, 64)
            print(
                f"trainer_memory: the full-logits variant needs ~{per_token * tokens_per_sample / 2**30:.1f} GiB "
                f"at {tokens_per_sample} tokens per sample, {available / 2**30:.1f} GiB is available: measuring "
                f"at {fits} tokens per sample instead",
                file=sys.stderr,
            )
            tokens_per_sample = fits
    logits_bytes = BATCH * tokens_per_sample * VOCAB_SIZE * 4
    results = {}
    for variant, chunk_tokens in variants.items():
        command = [
            sys.executable,
            __file__,
            "--child",
            str(chunk_tokens),
            "--tokens-per-sample",
            str(tokens_per_sample),
        ]
        child = subprocess.run(command, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            killed = " (killed: out of memory?)" if child.returncode == -9 else ""
            sys.exit(f"variant {variant} failed (exit {child.returncode}){killed}:\n{child.stderr[-4000:]}")
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    baseline = results["full_logits"]["peak_bytes"] if "full_logits" in results else None
    for variant, chunk_tokens in variants.items():
        figure = results[variant]
        print(
            json.dumps(
                {
                    "benchmark": "trainer_memory",
                    "variant": variant,
                    "logprob_chunk_tokens": chunk_tokens,
                    "batch": BATCH,
                    "tokens_per_sample": tokens_per_sample,
                    "vocab_size": VOCAB_SIZE,
                    "peak_bytes": figure["peak_bytes"],
                    "logits_bytes": logits_bytes,
                    "peak_over_logits": round(figure["peak_bytes"] / logits_bytes, 3),
                    "step_seconds": round(figure["step_seconds"], 2),
                    "baseline": "full_logits",
                    "baseline_peak_bytes": baseline,
                    "reduction": None if baseline is None else round(baseline / figure["peak_bytes"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
