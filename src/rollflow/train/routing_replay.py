"""Routing replay for mixture-of-experts models: the trainer's forward sends each token to the experts the
sampler chose for it, so the policy being trained is the one that sampled.

Without it, a router whose logits differ in the last bits between sampler and trainer (other kernels, bf16,
a stale policy) picks other experts for some tokens, and those tokens' logprobs, ratios and gradients belong to
a policy that never sampled them. With replay, each MoE router still computes its logits and softmax (so its
weights get gradients through the gate values), but takes the top-k expert *ids* from the sample's recorded
``routed_experts`` (``[tokens, moe_layers, topk]``, as the engines and the TITO proxy return them); the gate
values are the softmax at those ids, renormalised when the model normalises its top-k (Qwen3-MoE's
``norm_topk_prob``). Positions without a record (the last sampled token, which no engine ran; padding;
samples without routes) keep the router's own choice.

The router's ``forward`` is wrapped once per model (``install``); ``set_routes`` then holds one micro-batch's
routes on the routers until the next call, so a gradient-checkpointing recompute in the backward replays
the same routes. Routers of the Hugging Face form ``forward(hidden) -> (logits, scores, expert_ids)`` with
``top_k`` and ``norm_topk_prob`` (Qwen3-MoE's ``Qwen3MoeTopKRouter``) are supported.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

_ROUTES = "_rollflow_replay_routes"


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE block, in layer order (the order of ``routed_experts``' layer axis)."""
    routers = []
    for module in model.modules():
        router = getattr(module, "gate", None)
        if hasattr(module, "experts") and isinstance(router, torch.nn.Module) and hasattr(router, "top_k"):
            routers.append(router)
    return routers


def install(model: torch.nn.Module) -> bool:
    """Wrap the forward of every MoE router of ``model`` for replay (idempotent); False for a dense model."""
    routers = moe_routers(model)
    for router in routers:
        if not hasattr(router, _ROUTES):
            setattr(router, _ROUTES, None)
            router.forward = types.MethodType(_replaying_forward, router)
    return bool(routers)


def set_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Replay ``routes`` (``[batch, time, moe_layers, topk]`` expert ids, -1 where unknown) in the next
    forwards of ``model`` (the input must be ``[batch, time]``); None lets every router choose.

    Raises:
        ValueError: the routes do not fit the model (layer count, top-k, or an expert id out of range).
    """
    routers = moe_routers(model)
    if routes is not None:
        _, _, layers, topk = routes.shape
        if layers != len(routers) or topk != routers[0].top_k:
            raise ValueError(
                f"samples carry routed experts for {layers} MoE layers x top-{topk}; the trained model has "
                f"{len(routers)} MoE layers x top-{routers[0].top_k if routers else 0}: they were sampled "
                "from another model"
            )
        largest = int(routes.max()) if routes.numel() else -1
        if largest >= routers[0].num_experts:
            raise ValueError(
                f"samples carry routed expert id {largest}; the trained model has {routers[0].num_experts} experts"
            )
    for index, router in enumerate(routers):
        if not hasattr(router, _ROUTES):
            raise RuntimeError("set_routes before install(model)")
        setattr(
            router, _ROUTES, None if routes is None else routes[:, :, index].reshape(-1, routes.shape[-1])
        )


def collate_routes(samples: Sequence[Any], time_len: int) -> torch.Tensor | None:
    """Right-padded ``[batch, time_len, moe_layers, topk]`` long tensor of the samples' ``routed_experts``
    (-1 where a sample has none); None when no sample has any.

    A sample's record covers its first tokens (``prompt + completion``, or one fewer: the last sampled token
    was never run); rows past its length are left out.

    Raises:
        ValueError: samples with routes of different ``[moe_layers, topk]``.
    """
    import numpy as np

    records = [getattr(sample, "routed_experts", None) for sample in samples]
    shapes = {tuple(record.shape[1:]) for record in records if record is not None}
    if not shapes:
        return None
    if len(shapes) != 1:
        raise ValueError(
            f"the samples of one batch carry routed experts of different [layers, topk]: {shapes}"
        )
    ((layers, topk),) = shapes
    routes = torch.full((len(samples), time_len, layers, topk), -1, dtype=torch.long)
    for row, record in enumerate(records):
        if record is not None:
            rows = min(len(record), time_len)
            routes[row, :rows] = torch.from_numpy(np.array(record[:rows], dtype=np.int64))
    return routes


def _replaying_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """The router's own forward, then its top-k ids replaced by the held routes (bound to each router, so
    a deep copy of the model replays on its own routers)."""
    logits, scores, expert_ids = type(self).forward(self, hidden_states, *args, **kwargs)
    routes = getattr(self, _ROUTES)
    if routes is None:
        return logits, scores, expert_ids
    if routes.shape[0] != expert_ids.shape[0]:
        raise ValueError(
            f"routing replay holds routes for {routes.shape[0]} tokens but the forward runs "
            f"{expert_ids.shape[0]}; call rollflow.train.routing_replay.set_routes(model, None) before "
            "other forwards of a trained MoE model"
        )
    chosen = torch.where(routes >= 0, routes.to(device=expert_ids.device), expert_ids)
    # The router's arithmetic (float32 softmax, top-k renormalised), at the replayed ids.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    gates = probs.gather(-1, chosen)
    if getattr(self, "norm_topk_prob", False):
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return logits, gates.to(logits.dtype), chosen
