"""The token segments of a rendered prompt: where each message's tokens end, where two token runs part, and
the MoE routes (one row per token) aligned with them. Pure functions of ``Trace`` (``rollflow.tito.trace``)."""

from __future__ import annotations

from array import array
from typing import Any

from rollflow.errors import RoutedExpertsError


def common_prefix(a: array, b: array) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def segment_ends(indices: list[int], start: int, num_messages: int, first_index: int) -> list[int]:
    """End position of each new message's token segment: just after its last attributed token, never
    before ``start`` or the previous end. Scaffolding after the last message (the generation prompt) then
    belongs to the assistant node that follows."""
    ends = [start] * num_messages
    for position in range(start, len(indices)):
        index = indices[position] - first_index
        if 0 <= index < num_messages:
            ends[index] = position + 1
    for i in range(1, num_messages):
        ends[i] = max(ends[i], ends[i - 1])
    return ends


def align_routed_experts(experts: Any, total: int) -> Any:
    """Validate ``[tokens, layers, topk]`` integer indices; engines omit the last position, which is padded
    with a copy of the one before (any valid expert ids do at the end of a sequence; a later turn that
    extends it replaces the copy with the routes it computed, see ``Trace._repair_routes``)."""
    if experts is None:
        return None
    import numpy as np

    experts = np.asarray(experts)
    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
        raise RoutedExpertsError(
            f"routed_experts must be an integer array [tokens, layers, topk], got dtype {experts.dtype} "
            f"and shape {experts.shape}"
        )
    if experts.shape[0] == total - 1 and total > 1:
        experts = np.concatenate([experts, experts[-1:]], axis=0)
    if experts.shape[0] != total:
        raise RoutedExpertsError(
            f"routed_experts has {experts.shape[0]} rows for {total} prompt + completion tokens "
            f"(expected {total} or {total - 1})"
        )
    return experts.astype(np.int32, copy=False)


def expert_rows(experts: Any, start: int, end: int) -> Any:
    """The routes of tokens ``start:end`` as their own array (None without routes)."""
    return None if experts is None else experts[start:end].copy()
