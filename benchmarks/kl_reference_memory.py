"""Parameter memory of the KL penalty's reference policy (``trainer.kl_coef > 0``) per trainer rank.

Builds each rank of ``trainer.num_workers = 2`` as the workers do (``rollflow.train.workers.build_rank``, real
gloo group, the tiny model) under ``fsdp2`` and ``ddp``, and a single ``Trainer``, and counts the bytes of the
parameters each holds in its own memory (a DTensor's local shard), for the policy (the baseline, same run) and
the reference. Also says whether the reference has any parameter that needs a gradient and how many tensors
the optimizer holds (the policy's only).

Prints one JSON line per rank:
{"benchmark": "kl_reference_memory", "parallelism": "fsdp2", "rank": 0, "reference_bytes": ...,
 "baseline": "policy_bytes", "policy_bytes": ..., "reference_over_policy": 1.0, "full_model_bytes": ...,
 "reference_requires_grad": false, "optimizer_tensors": ..., "policy_tensors": ...}
(``parallelism`` "single" is the single trainer). Usage: ``python benchmarks/kl_reference_memory.py``.
"""

from __future__ import annotations

import json
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def local_bytes(model) -> int:
    total = 0
    for parameter in model.parameters():
        tensor = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += tensor.numel() * tensor.element_size()
    return total


def figures(trainer, parallelism: str, rank: int) -> dict:
    policy, reference = local_bytes(trainer.model), local_bytes(trainer.reference_model)
    return {
        "benchmark": "kl_reference_memory",
        "parallelism": parallelism,
        "rank": rank,
        "reference_bytes": reference,
        "baseline": "policy_bytes",
        "policy_bytes": policy,
        "reference_over_policy": reference / policy,
        "reference_requires_grad": any(p.requires_grad for p in trainer.reference_model.parameters()),
        "optimizer_tensors": sum(len(group["params"]) for group in trainer.optimizer.param_groups),
        "policy_tensors": sum(1 for _ in trainer.model.parameters()),
    }


def rank_main(rank: int, parallelism: str, port: int, queue) -> None:
    from rollflow.config import TrainerConfig
    from rollflow.models.tiny import ensure_tiny_model
    from rollflow.train.process import TrainerSpec
    from rollflow.train.workers import build_rank, leave_group, open_store

    config = TrainerConfig(num_workers=2, parallelism=parallelism, kl_coef=0.1)
    spec = TrainerSpec(
        model_dir=ensure_tiny_model(),
        config=config,
        temperature=1.0,
        pad_token_id=0,
        seed=0,
        off_policy="none",
    )
    store = open_store("127.0.0.1", port, 2, is_master=rank == 0)
    trainer = build_rank(spec, rank, 2, "cpu", 1, store, cuda_index=0)
    queue.put(figures(trainer, parallelism, rank))
    leave_group()


def main() -> None:
    import torch.multiprocessing as mp

    from rollflow.config import TrainerConfig
    from rollflow.models.loading import load_causal_lm
    from rollflow.models.tiny import ensure_tiny_model
    from rollflow.train.trainer import Trainer

    single = Trainer(load_causal_lm(ensure_tiny_model()), TrainerConfig(kl_coef=0.1))
    full = local_bytes(single.model)
    print(json.dumps({**figures(single, "single", 0), "full_model_bytes": full}), flush=True)
    context = mp.get_context("spawn")
    for parallelism in ("fsdp2", "ddp"):
        with socket.socket() as probe:  # rank 0 hosts the store on a port free a moment ago
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        queue = context.Queue()
        processes = [context.Process(target=rank_main, args=(r, parallelism, port, queue)) for r in range(2)]
        for process in processes:
            process.start()
        rows = sorted((queue.get(timeout=300) for _ in processes), key=lambda row: row["rank"])
        for process in processes:
            process.join()
        for row in rows:
            print(json.dumps({**row, "full_model_bytes": full}), flush=True)


if __name__ == "__main__":
    main()
