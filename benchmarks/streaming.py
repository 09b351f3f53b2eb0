"""What streaming costs and what it buys: throughput of streamed vs whole generation, and time to first token.

Three layers, each measured with its non-streamed baseline in the same process, alternating ``--repeats``
times (the machine is shared and noisy): the in-process ``TorchEngine`` (``generate_stream`` vs ``generate``),
``RemoteInferenceClient`` over HTTP to an engine server in this process (SSE from ``/v1/completions`` vs JSON
from ``/inference/v1/generate``), each with ``--concurrency`` requests of ``--tokens`` tokens (no stop token:
the budget is the length); and one agent turn through the TITO proxy with the ``openai`` client (a seeded
847-token reply of the tiny model; the client runs in this process too). Prints one JSON line per
measurement and one summary line per layer.

    python benchmarks/streaming.py [--tokens 256] [--concurrency 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from rollflow.inference.client import collect_stream
from rollflow.inference.engine.server import EngineServer
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.messages import GenerateRequest, SamplingParams


async def run_once(client, streamed: bool, tokens: int, concurrency: int) -> dict[str, float]:
    first_token_s: list[float] = []

    async def one(index: int) -> int:
        request = GenerateRequest(
            [5, 6, 7 + index], SamplingParams(max_tokens=tokens, seed=index), f"b{index}"
        )
        started = time.perf_counter()
        if not streamed:
            output = await client.generate(request)
            first_token_s.append(time.perf_counter() - started)  # the whole answer is the first thing seen
            return len(output.token_ids)
        count = 0
        async for chunk in client.generate_stream(request):
            if not count and chunk.token_ids:
                first_token_s.append(time.perf_counter() - started)
            count += len(chunk.token_ids)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    assert sum(counts) == tokens * concurrency
    return {"tokens_per_s": sum(counts) / elapsed, "first_token_s": statistics.median(first_token_s)}


async def compare(layer: str, client, args: argparse.Namespace) -> None:
    await collect_stream(
        client.generate_stream(GenerateRequest([5], SamplingParams(max_tokens=4)))
    )  # warm up
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for streamed in (False, True):
            result = await run_once(client, streamed, args.tokens, args.concurrency)
            results[streamed].append(result)
            print(
                json.dumps(
                    {
                        "benchmark": "streaming",
                        "layer": layer,
                        "streamed": streamed,
                        "repeat": repeat,
                        **result,
                    }
                )
            )
    whole = statistics.median(r["tokens_per_s"] for r in results[False])
    streamed = statistics.median(r["tokens_per_s"] for r in results[True])
    summary = {
        "benchmark": "streaming",
        "layer": layer,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "whole_tokens_per_s": round(whole, 1),
        "streamed_tokens_per_s": round(streamed, 1),
        "streamed_over_whole": round(streamed / whole, 3),
        "whole_answer_s": round(statistics.median(r["first_token_s"] for r in results[False]), 4),
        "streamed_first_token_s": round(statistics.median(r["first_token_s"] for r in results[True]), 4),
    }
    print(json.dumps(summary))


async def compare_tito(server: EngineServer, args: argparse.Namespace) -> None:
    import openai

    from rollflow.inference.client import LocalInferenceClient
    from rollflow.tito import TITOProxy

    client = LocalInferenceClient([server.engine])
    request = {"model": "tiny", "messages": [{"role": "user", "content": "write a long story"}], "seed": 3}
    request["max_tokens"] = 900
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    async with TITOProxy(client, server.renderer, server.tokenizer, model_name="tiny") as proxy:
        for repeat in range(args.repeats):
            for streamed in (False, True):
                session = await proxy.open_session()
                agent = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
                started, first_s = time.perf_counter(), None
                if streamed:
                    async for chunk in await agent.chat.completions.create(**request, stream=True):
                        if first_s is None and chunk.choices and chunk.choices[0].delta.content:
                            first_s = time.perf_counter() - started
                else:
                    await agent.chat.completions.create(**request)
                elapsed = time.perf_counter() - started
                await agent.close()
                await proxy.close_session(session)
                result = {"turn_s": elapsed, "first_content_s": first_s or elapsed}
                results[streamed].append(result)
                print(
                    json.dumps(
                        {
                            "benchmark": "streaming",
                            "layer": "tito",
                            "streamed": streamed,
                            "repeat": repeat,
                            **result,
                        }
                    )
                )
    whole = statistics.median(r["turn_s"] for r in results[False])
    streamed = statistics.median(r["turn_s"] for r in results[True])
    summary = {
        "benchmark": "streaming",
        "layer": "tito",
        "whole_turn_s": round(whole, 4),
        "streamed_turn_s": round(streamed, 4),
        "streamed_over_whole_time": round(streamed / whole, 3),
        "streamed_first_content_s": round(statistics.median(r["first_content_s"] for r in results[True]), 4),
    }
    print(json.dumps(summary))


async def main(args: argparse.Namespace) -> None:
    server = EngineServer.from_model("rollflow:tiny", max_batch_size=args.concurrency, max_model_len=1024)
    server.engine.enable_prefix_caching = (
        False  # the same prompt each run: a cache hit would change its reply
    )
    try:
        await compare("engine", server.engine, args)
        url = await server.start()
        async with RemoteInferenceClient(url) as client:
            await compare("http", client, args)
        await compare_tito(server, args)
    finally:
        await server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
