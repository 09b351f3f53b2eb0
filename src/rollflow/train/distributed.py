"""What a training step does differently on a data-parallel rank: reductions, gradient sync, clipping.

``Trainer`` calls these through ``Trainer.parallel``: ``SingleProcess`` (the default: every operation is local)
or ``DataParallel`` (set by a worker of ``rollflow.train.workers`` once its process group is up).

Gradients are *summed* over ranks, never averaged: each rank's loss is already divided by the update's counts
over all ranks (its mini-batch's loss tokens or sequences, ``aggregation.py``), so the sum is the gradient of
the update's loss however the samples were split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

Parallelism = Literal["fsdp2", "ddp"]


class SingleProcess:
    """The one rank of a trainer without a process group."""

    rank = 0
    world_size = 1

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        return values

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        pass

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm)


SINGLE_PROCESS = SingleProcess()


class DataParallel:
    """This process's rank of an initialised ``torch.distributed`` group.

    Args:
        parallelism: ``fsdp2`` (the model went through ``shard_model``: FSDP reduce-scatters gradients in the
            backward pass) or ``ddp`` (whole model per rank: ``sync_gradients`` all-reduces them).
    """

    def __init__(self, parallelism: Parallelism):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs an initialised torch.distributed process group")
        self.parallelism = parallelism
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """The element-wise sum (or maximum) of ``values`` over every rank (a new tensor)."""
        import torch.distributed as dist

        reduced = values.detach().clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return reduced

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Leave every rank with the sum of the ranks' gradients. ``ddp``: all-reduced here, in one flat
        buffer per dtype (one collective each). ``fsdp2``: FSDP reduce-scattered the shards in the backward
        pass as a mean (its custom divide factor needs ``PREMUL_SUM``, which gloo lacks); undone here."""
        if self.parallelism == "fsdp2":
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(self.world_size)
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for parameter in parameters:
            if parameter.requires_grad:
                if parameter.grad is None:  # unused this step here, maybe not on another rank
                    parameter.grad = torch.zeros_like(parameter)
                by_dtype.setdefault(parameter.grad.dtype, []).append(parameter.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, sharded=self.parallelism == "fsdp2")


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, sharded: bool = False
) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the norm before.

    The squared norms are summed in float64: a float32 norm of one vocabulary-sized gradient is off in its
    sixth digit, and by a different amount for a shard than for the whole tensor, so the same step would
    report another norm on another number of ranks. With ``sharded`` (DTensor gradients, disjoint shards)
    each rank sums its shards' squares and one all-reduce adds the ranks'.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    squares = torch.zeros((), dtype=torch.float64, device=local[0].device if local else None)
    for grad in local:
        squares = squares + torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    if sharded:
        import torch.distributed as dist

        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    total = squares.sqrt()
    # As torch.nn.utils.clip_grad_norm_: the 1e-6 keeps a zero norm finite, and gradients are never scaled up.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in local:
        grad.mul_(coefficient.to(grad.dtype))
    return total.float()


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, head), in place.

    Decoder layers are the modules whose class the model names in ``_no_split_modules`` (what Hugging Face
    models declare for sharding). Parameters compute in ``param_dtype`` (None: their own) and gradients are
    reduced in float32, averaged over ranks (``DataParallel.sync_gradients`` turns the mean into the sum).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
