"""Generation throughput: rollflow's TorchEngine against Hugging Face ``model.generate`` on the same prompts.

Both generate exactly ``--new-tokens`` tokens per prompt, greedily: the engine with no stop tokens, HF with
``min_new_tokens`` so eos cannot end a sequence early. Each figure is the median of ``--repeats`` timed runs after
one warm-up run each, measured in this one process with the two sides interleaved, so both see the same
(shared, noisy) machine. torch's thread count is left at its default; the engine's worker runs with its own
``num_threads`` (default 1, ``--engine-num-threads none`` keeps torch's count), reported in the output.

Prints one JSON line per batch size:
{"benchmark": "engine_throughput", "batch_size": 64, "new_tokens": 32, "rollflow_tokens_per_s": ...,
 "hf_generate_tokens_per_s": ..., "ratio": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Longer than TorchEngine.idle_exit_s: the engine's worker thread has exited when HF starts.
IDLE_PAUSE_S = 0.2


def make_prompts(batch_size: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts of 50-70 tokens (about 60), so HF has to pad and the engine to batch ragged rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 71, (batch_size,), generator=generator).tolist()
    # Skip the first few ids: the tiny tokenizer's special tokens.
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def time_hf(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int) -> float:
    import torch

    width = max(len(p) for p in prompts)
    # Left padding, as generate expects for decoder-only models.
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert output.shape[1] - width == new_tokens, (output.shape, width, new_tokens)
    return len(prompts) * new_tokens / elapsed


async def time_engine(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from rollflow.messages import GenerateRequest, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = await asyncio.gather(*(engine.generate(GenerateRequest(p, params)) for p in prompts))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert generated == len(prompts) * new_tokens, (generated, len(prompts), new_tokens)
    return generated / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="rollflow:tiny", help="local HF model directory or rollflow:tiny")
    parser.add_argument(
        "--engine-num-threads",
        default="1",
        help="TorchEngine(num_threads=...): intra-op threads of the engine's worker, or 'none' for torch's count",
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.inference.engine import TorchEngine
    from rollflow.models.tiny import TINY_MODEL_NAME, ensure_tiny_model

    num_threads = None if args.engine_num_threads.lower() == "none" else int(args.engine_num_threads)
    path = str(ensure_tiny_model()) if args.model == TINY_MODEL_NAME else args.model
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad_token_id = hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0
    for batch_size in args.batch_sizes:
        prompts = make_prompts(batch_size, hf_model.config.vocab_size)
        # The engine gets its own model, as the orchestrator gives it.
        engine = TorchEngine.from_pretrained(
            path, max_batch_size=batch_size, max_model_len=256, num_threads=num_threads
        )
        try:
            await time_engine(engine, prompts, args.new_tokens)  # warm-up
            await asyncio.sleep(IDLE_PAUSE_S)
            time_hf(hf_model, prompts, args.new_tokens, pad_token_id)
            ours, theirs = [], []
            # Interleaved, so load from other processes on the machine hits both sides alike.
            for _ in range(args.repeats):
                ours.append(await time_engine(engine, prompts, args.new_tokens))
                # Let the idle engine's worker thread exit, so HF runs without its OpenMP team around.
                await asyncio.sleep(IDLE_PAUSE_S)
                theirs.append(time_hf(hf_model, prompts, args.new_tokens, pad_token_id))
        finally:
            await engine.shutdown()
        rollflow_tps, hf_tps = statistics.median(ours), statistics.median(theirs)
        print(
            json.dumps(
                {
                    "benchmark": "engine_throughput",
                    "batch_size": batch_size,
                    "new_tokens": args.new_tokens,
                    "rollflow_tokens_per_s": round(rollflow_tps, 1),
                    "hf_generate_tokens_per_s": round(hf_tps, 1),
                    "ratio": round(rollflow_tps / hf_tps, 3),
                    "engine_num_threads": num_threads,
                    # Other processes on a 2-core machine slow both sides a lot (OpenMP threads wait).
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
