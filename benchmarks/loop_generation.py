"""Generation in the training loop against the engine alone, on the same batch.

The quickstart's step generates 16 prompts x 8 samples of up to 8 tokens at temperature 1, each sample with its
own seed. Two measurements, alternated in this one process so both see the same (shared, noisy) machine:

- ``loop``: ``examples/quickstart.toml`` run for ``--steps`` steps through ``Orchestrator`` (sync mode, the
  in-process engine); the figure is the median of the steps' ``generation_time_s`` (first step left out:
  warm-up), which spans rendering, sampling, scoring and the hand-offs between the loop and the engine thread.
- ``engine``: the same model in a ``TorchEngine`` of the config's size, given the same requests directly
  (the first 16 prompts of the case task rendered by the same renderer, the run's per-sample seeds, its stop
  token), ``asyncio.gather`` over the 128 ``generate`` calls; median of ``--repeats`` timed calls after a
  warm-up.

Prints one JSON line per round and a summary:
{"benchmark": "loop_generation", "round": 0, "loop_generation_s": ..., "engine_generation_s": ..., "ratio": ...,
 "load_1m": ...}

Usage: ``python benchmarks/loop_generation.py [--steps 30] [--rounds 2] [--repeats 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.toml"


async def loop_generation(steps: int) -> float:
    from rollflow import Orchestrator, load_config

    with tempfile.TemporaryDirectory() as directory:
        overrides = [f"orchestrator.steps={steps}", "checkpoint.every=0", f"output_dir='{directory}'"]
        config = load_config([QUICKSTART], overrides)
        async with Orchestrator(config) as orchestrator:
            metrics = await orchestrator.run()
    return statistics.median(m["generation_time_s"] for m in metrics[1:])


def engine_requests(config) -> tuple[list, str]:
    from rollflow.messages import GenerateRequest, SamplingParams
    from rollflow.models.loading import create_chat_renderer, load_tokenizer, resolve_model_path
    from rollflow.rollout.generator import sample_seed
    from rollflow.rollout.tasks import CaseTask

    model_dir = resolve_model_path(config.model.path)
    tokenizer = load_tokenizer(model_dir)
    renderer = create_chat_renderer(tokenizer, config.model, model_dir)
    stops = list(renderer.get_stop_token_ids())
    task = CaseTask(config.data.seed)
    requests = []
    for prompt_index in range(config.orchestrator.prompts_per_step):
        prompt = list(renderer.render_ids(task.item(prompt_index).messages, add_generation_prompt=True))
        for sample_index in range(config.sampling.samples_per_prompt):
            params = SamplingParams(
                max_tokens=config.sampling.max_tokens,
                temperature=config.sampling.temperature,
                seed=sample_seed(config.seed, prompt_index, sample_index),
                stop_token_ids=stops,
            )
            requests.append(GenerateRequest(prompt, params, request_id=f"p{prompt_index}-s{sample_index}"))
    return requests, str(model_dir)


async def engine_generation(engine, requests: list, repeats: int) -> float:
    await asyncio.gather(*(engine.generate(r) for r in requests))  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await asyncio.gather(*(engine.generate(r) for r in requests))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="quickstart steps per loop measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of loop and engine")
    parser.add_argument("--repeats", type=int, default=10, help="timed engine calls per round")
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.repeats < 1:
        parser.error("--steps must be >= 2, --rounds and --repeats >= 1")

    from rollflow import load_config
    from rollflow.inference.engine import TorchEngine

    config = load_config([QUICKSTART], [])
    requests, model_dir = engine_requests(config)
    engine = TorchEngine.from_pretrained(
        model_dir,
        max_batch_size=config.inference.max_batch_size,
        max_model_len=config.inference.max_model_len,
    )
    loops, engines = [], []
    try:
        for index in range(args.rounds):
            engines.append(await engine_generation(engine, requests, args.repeats))
            await asyncio.sleep(0.2)  # the idle engine's worker thread exits before the loop runs
            loops.append(await loop_generation(args.steps))
            line = {
                "benchmark": "loop_generation",
                "round": index,
                "batch": len(requests),
                "loop_generation_s": round(loops[-1], 4),
                "engine_generation_s": round(engines[-1], 4),
                "ratio": round(loops[-1] / engines[-1], 3),
                "load_1m": round(os.getloadavg()[0], 2),
            }
            print(json.dumps(line), flush=True)
    finally:
        await engine.shutdown()
    loop_s, engine_s = statistics.median(loops), statistics.median(engines)
    summary = {
        "benchmark": "loop_generation",
        "summary": True,
        "batch": len(requests),
        "loop_generation_s": round(loop_s, 4),
        "baseline": "engine",
        "engine_generation_s": round(engine_s, 4),
        "ratio": round(loop_s / engine_s, 3),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
