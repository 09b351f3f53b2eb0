"""Weight-sync throughput: ``broadcast`` (gloo) and ``checkpoint`` (HTTP and shared file) against an in-process copy.

Each strategy pushes a model's full state dict to one receiver process that does what an engine server does:
``create_receiver`` once, then per push ``receive`` and copy the tensors into its own model
(``load_state_dict(strict=False)``). The trainer pushes: the strategy's transport half runs where the weights
are (``--placement thread``: a worker thread of this process, as ``trainer.placement = "thread"``; ``process``:
a child process holding the model, as ``trainer.placement = "process"``) while its control half drives the
receiver from this event loop. A push is timed from the control half, start to the receiver's reply, so it
includes packing or serializing, the transfer and the receiver's load. The baseline, measured in the same run,
is ``load_state_dict`` from one in-process model into another. Each figure is the median of ``--repeats``
pushes after one warm-up push. Models: the tiny model and a randomly initialised ~100M-parameter Qwen3 built
from a config (nothing is downloaded).

Prints one JSON line per model, placement and strategy:
{"benchmark": "weight_sync", "model": "qwen3-100m", "params": ..., "bytes": ..., "placement": "thread",
 "strategy": "broadcast-gloo", "seconds": ..., "bytes_per_s": ..., "baseline": "in_process_load_state_dict",
 "baseline_bytes_per_s": ..., "ratio": ...}
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _models import QWEN3_100M
from rollflow.inference.control import WorldSize

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECEIVER_PROCESS = """
import json, sys
replies, sys.stdout = sys.stdout, sys.stderr
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from rollflow.weights.server.receiver import create_receiver
torch.set_num_threads(1)
model = receiver = None
for line in sys.stdin:
    message = json.loads(line)
    if message["op"] == "model":
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config.from_dict(message["config"]))
        model.to_empty(device="cpu")
    elif message["op"] == "init":
        receiver = create_receiver(message["init_info"], 0)
    else:
        tensors = receiver.receive(message["update_info"])
        model.load_state_dict(dict(tensors), strict=False)
    print("{}", file=replies, flush=True)
"""


class ReceiverProcess:
    """One engine-like receiver in a subprocess, driven the way ``RemoteInferenceClient`` drives a server."""

    async def start(self, config: dict[str, Any]) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            RECEIVER_PROCESS,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        await self._call({"op": "model", "config": config})

    async def _call(self, message: dict[str, Any]) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        await self.process.stdin.drain()
        if not await self.process.stdout.readline():
            raise RuntimeError("the receiver process died; see its stderr above")

    server_urls = ("receiver://0",)

    async def world_size(self) -> WorldSize:
        return WorldSize(total_workers=1, workers_per_server=1, num_servers=1, server_urls=self.server_urls)

    async def init_weight_transfer(self, init_infos: Sequence[dict[str, Any]]) -> None:
        await self._call({"op": "init", "init_info": dict(init_infos[0])})

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._call({"op": "update", "update_info": update_info})

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        pass

    async def close(self) -> None:
        self.process.stdin.close()
        await self.process.wait()


def build_models(name: str) -> tuple[Any, Any]:
    """A source model (random init, seeded) and a target of the same architecture."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name == "tiny":
        from rollflow.models.loading import load_causal_lm
        from rollflow.models.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        return load_causal_lm(path), load_causal_lm(path)
    config = Qwen3Config(**QWEN3_100M)
    torch.manual_seed(0)
    source = Qwen3ForCausalLM(config)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(config)
    return source, target.to_empty(device="cpu")


def state_bytes(model: Any) -> tuple[int, int]:
    """Parameters (tied ones once) and bytes pushed (the whole state dict: a tied lm_head is sent too)."""
    state = model.state_dict()
    return sum(p.numel() for p in model.parameters()), sum(
        t.numel() * t.element_size() for t in state.values()
    )


def time_in_process(source: Any, target: Any, repeats: int) -> float:
    state = source.state_dict()
    target.load_state_dict(state)
    times = []
    # More repeats than the pushes: it is cheap, and on a shared 2-core machine single copies vary 50x.
    for _ in range(max(repeats, 15)):
        start = time.perf_counter()
        target.load_state_dict(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class ModelInProcess:
    """A trainer handle over ``model`` in a child process: ``push_weights(call)`` runs the transport call
    there, on the child's own copy of the weights (what ``TrainerProcess`` does, without an optimizer)."""

    def __init__(self, model: Any):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_model, args=(child, model.state_dict()), daemon=True)
        self._process.start()
        child.close()
        self._conn.recv()  # ready

    def push_weights(self, call: Any) -> Any:
        self._conn.send(call)
        status, value = self._conn.recv()
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        self._conn.close()
        self._process.join(30)


def _serve_model(conn: Any, state: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    weights = {name: tensor.clone() for name, tensor in state.items()}  # the child's own memory
    conn.send("ready")
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", call(0, weights.items())))
        except Exception as error:
            conn.send(("error", error))


async def time_strategy(
    strategy_name: str, options: dict[str, Any], source: Any, placement: str, repeats: int
) -> float:
    from rollflow.weights import StaticWeights, connect_sender, create_strategy

    receiver = ReceiverProcess()
    await receiver.start(source.config.to_dict())
    trainer = ModelInProcess(source) if placement == "process" else StaticWeights(source.state_dict().items)
    sender = await connect_sender(create_strategy(strategy_name, timeout_s=600, **options), receiver, trainer)
    try:
        times = []
        for version in range(repeats + 1):
            start = time.perf_counter()
            await sender.push(receiver, trainer, policy_version=version)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        sender.close()
        await receiver.close()
        if placement == "process":
            trainer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-100m"], choices=["tiny", "qwen3-100m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-size-mb", type=float, default=64.0, help="broadcast bucket size")
    parser.add_argument(
        "--placement",
        nargs="+",
        default=["thread"],
        choices=["thread", "process"],
        help="where the trainer runs",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="weight-sync-") as shared_dir:
        strategies = [
            ("broadcast-gloo", "broadcast", {"backend": "gloo", "bucket_size_mb": args.bucket_size_mb}),
            ("checkpoint-http", "checkpoint", {}),
            ("checkpoint-file", "checkpoint", {"checkpoint_dir": Path(shared_dir)}),
        ]
        for model_name in args.models:
            source, target = build_models(model_name)
            params, nbytes = state_bytes(source)
            baseline_s = time_in_process(source, target, args.repeats)
            del target
            for placement, (label, strategy_name, options) in (
                (placement, strategy) for placement in args.placement for strategy in strategies
            ):
                seconds = await time_strategy(strategy_name, options, source, placement, args.repeats)
                record = {
                    "benchmark": "weight_sync",
                    "model": model_name,
                    "params": params,
                    "bytes": nbytes,
                    "placement": placement,
                    "strategy": label,
                    "seconds": round(seconds, 5),
                    "bytes_per_s": round(nbytes / seconds),
                    "baseline": "in_process_load_state_dict",
                    "baseline_seconds": round(baseline_s, 5),
                    "baseline_bytes_per_s": round(nbytes / baseline_s),
                    "ratio": round(baseline_s / seconds, 4),
                }
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
