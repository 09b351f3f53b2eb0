"""Trainer worker groups in tests: their spec, the parity bounds against one trainer, a push that counts."""

from __future__ import annotations

from rollflow.config import TrainerConfig
from rollflow.train.process import TrainerSpec

PARITY = 1e-5  # loss and grad norm
WEIGHT_PARITY = 1e-4  # weights after a step (AdamW's first steps amplify float noise of near-zero gradients)


def spec(model_dir, **config) -> TrainerSpec:
    return TrainerSpec(
        model_dir=model_dir,
        config=TrainerConfig(**{"micro_batch_size": 3, **config}),
        temperature=1.0,
        pad_token_id=0,
        seed=0,
        off_policy="none",
    )


def count_weights(rank, named_weights):
    """A transport half's shape: every rank gathers every tensor; rank 0 would send them. Returns the rank,
    the sum of the full weights and the ranks that took part (gathered from all of them)."""
    import torch.distributed as dist

    total = 0.0
    for _, tensor in named_weights:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        total += float(full.double().sum())
    if not dist.is_initialized():  # a single trainer: rank 0 of one
        return rank, total, [(rank, total)]
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (rank, total))
    return rank, total, ranks
