"""What a verifiers environment costs per trajectory over a plain agent, on the same proxy, engine and prompts.

One in-process engine of the tiny model and one TITO proxy; the case taskset of ``examples/envs/case_env.py``
(``env.kind = "verifiers"``: a verifiers episode per trajectory, through its interception server and
rollflow's in-process harness) against the baseline, an ``AgentGenerator`` whose agent makes the same single
chat call with the openai SDK. Both generate ``--groups`` groups of ``--samples`` trajectories, concurrently,
``--repeats`` times alternating; prints one JSON line per figure (median seconds per group, and the
trajectories per second) with the baseline of the same run.

    python benchmarks/env_overhead.py [--groups 8] [--samples 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai

from rollflow.config import EnvConfig
from rollflow.messages import RolloutRequest
from rollflow.rollout.agent import AgentGenerator
from rollflow.rollout.envs import EnvGenerator
from rollflow.rollout.envs.verifiers_env import VerifiersSource
from rollflow.tito import TITOProxy

CASE_ENV = Path(__file__).resolve().parent.parent / "examples" / "envs" / "case_env.py"
MODEL = "rollflow:tiny"


async def plain_agent(base_url, task):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        await client.chat.completions.create(model=task.model, messages=task.messages)
    return 0.0


async def timed(generator, requests) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(generator.generate_group(request) for request in requests))
    return time.perf_counter() - started


async def main(groups: int, samples: int, repeats: int) -> None:
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm
    from rollflow.models.tiny import ensure_tiny_model
    from rollflow.tito.testing import load_tiny_chat

    model_dir = ensure_tiny_model()
    chat = load_tiny_chat(model_dir)
    engine = TorchEngine(load_causal_lm(model_dir), max_batch_size=groups * samples, max_model_len=2048)
    config = EnvConfig(
        kind="verifiers",
        id=str(CASE_ENV),
        args={"agent": {"runtime": {"type": "subprocess"}}},
        max_seq_len=64,
        num_tasks=groups,
    )
    source = VerifiersSource(config, MODEL)
    requests = [
        RolloutRequest(prompt_index=i, messages=item.messages, metadata=item.metadata, num_samples=samples)
        for i, item in enumerate(source.task.items)
    ]
    client = LocalInferenceClient([engine])
    async with (
        source,
        TITOProxy(client, chat.renderer, chat.tokenizer, model_name=MODEL, default_max_tokens=8) as proxy,
    ):
        env = EnvGenerator(proxy, source, max_seq_len=64)
        agent = AgentGenerator(proxy, plain_agent, max_seq_len=64)
        await timed(env, requests[:1])  # warm-up: the interception server, the engine's first batch
        await timed(agent, requests[:1])
        env_s, agent_s = [], []
        for _ in range(repeats):
            env_s.append(await timed(env, requests))
            agent_s.append(await timed(agent, requests))
    trajectories = groups * samples
    env_median, agent_median = statistics.median(env_s), statistics.median(agent_s)
    common = {"groups": groups, "samples": samples, "repeats": repeats}
    print(
        json.dumps(
            {
                "figure": "verifiers_env_batch_s",
                "value": env_median,
                "baseline_plain_agent_s": agent_median,
                "unit": "s",
                **common,
            }
        )
    )
    print(
        json.dumps(
            {
                "figure": "verifiers_env_trajectories_per_s",
                "value": trajectories / env_median,
                "baseline_plain_agent": trajectories / agent_median,
                "unit": "1/s",
                **common,
            }
        )
    )
    print(
        json.dumps(
            {
                "figure": "verifiers_env_overhead_per_trajectory_ms",
                "value": 1000 * (env_median - agent_median) / trajectories,
                "unit": "ms",
                **common,
            }
        )
    )


if __name__ == "__main__":
    import importlib.util

    if importlib.util.find_spec("verifiers") is None:  # not in the dev extra (see noxfile.tests_envs)
        print(
            json.dumps({"figure": "verifiers_env_batch_s", "skipped": "needs pip install 'rollflow[envs]'"})
        )
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.groups, args.samples, args.repeats))
