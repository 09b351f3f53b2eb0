"""Shared prompts: the samples of a micro-batch that begin with the same prompt (a GRPO group) run that
prompt through the model once.

Each group's prompt becomes one packed row: the prompt, then its samples' completions one after another. A
block attention mask lets each completion see the prompt and its own earlier tokens, never another
completion, and position ids restart after the prompt for each completion, so every token is computed as it
is in a row of its own (equal up to float rounding). ``SharedPrompts.unpack`` lays the packed hidden states
back out as the micro-batch's ``[batch, time]`` rows; the backward of that gather sums each prompt's
gradient over its samples. 8 samples of a 17-token prompt with 8-token completions run 81 token positions
instead of 200: the trainer's step on the quickstart's shape takes 0.59-0.67 of the time on the CPU
(``benchmarks/shared_prompts.py``).

Only for models whose attention takes such a mask as it is (``supports_shared_prompts``: SDPA, no sliding
window, text only).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

MIN_SAVING = 0.2
"""Packing is used only when it removes at least this fraction of the micro-batch's padded token positions:
a dense block mask costs more attention than per-row causal attention, which little saving does not repay."""


@dataclass(frozen=True)
class SharedPrompts:
    """The packed layout of one micro-batch (``[rows, length]``: one row per group's prompt, or part of one)."""

    input_ids: torch.Tensor  # [rows, length] long, padded with the pad token
    position_ids: torch.Tensor  # [rows, length] long: each completion continues its prompt's positions
    attention_mask: torch.Tensor  # [rows, 1, length, length] bool: True where a query may attend to a key
    gather: torch.Tensor  # [batch, time] long: flat index into [rows * length] of each micro-batch position

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[rows, length, ...]`` values of the packed positions as the micro-batch's ``[batch, time, ...]``
        (a micro-batch's padding reads an arbitrary packed position)."""
        return packed.flatten(0, 1)[self.gather]

    def to(self, device: torch.device | str) -> SharedPrompts:
        """This layout on ``device``."""
        return SharedPrompts(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            gather=self.gather.to(device),
        )


def supports_shared_prompts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward computes packed rows exactly as separate ones: a text decoder whose
    attention is SDPA (it takes a 4D boolean mask as given; eager attention adds masks, flash attention takes
    none) and has no sliding window (a custom mask replaces it)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "vision_config", None) is not None:  # multimodal rotary positions are not 1D
        return False
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def pack_shared_prompts(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    time_len: int,
    pad_token_id: int,
    groups: Sequence[Hashable] | None = None,
) -> SharedPrompts | None:
    """The packed layout of a micro-batch of ``prompt + completion`` rows right-padded to ``time_len``, or
    None when sharing would save less than ``MIN_SAVING`` of its token positions.

    Samples with the same non-empty prompt (and the same entry of ``groups``, when given) share a packed row
    while it stays within ``max(2 * time_len, 512)`` positions (which bounds the dense mask); a longer group
    takes several rows. Groups keep rows apart: every packed row is padded to the longest, so merging two
    groups that happen to ask the same prompt would make every row longer than the one it saves.
    """
    shared: dict[tuple[Hashable, tuple[int, ...]], list[int]] = {}
    for row, prompt in enumerate(prompts):
        group = None if groups is None else groups[row]
        shared.setdefault((group, tuple(prompt) or (-1 - row,)), []).append(
            row
        )  # empty prompts share nothing
    cap = max(2 * time_len, 512)
    packed_rows: list[tuple[int, list[int]]] = []  # (prompt length, member rows)
    for members in shared.values():
        prompt_len = len(prompts[members[0]])
        current: list[int] = []
        used = prompt_len
        for row in members:
            size = len(completions[row])
            if current and used + size > cap:
                packed_rows.append((prompt_len, current))
                current, used = [], prompt_len
            current.append(row)
            used += size
        packed_rows.append((prompt_len, current))
    length = max(k + sum(len(completions[row]) for row in rows) for k, rows in packed_rows)
    if len(packed_rows) * length > (1 - MIN_SAVING) * len(prompts) * time_len:
        return None
    # Built as Python lists, made tensors once (per-row tensor writes would cost milliseconds a step).
    input_ids, position_ids, segments = [], [], []
    gather: list[list[int]] = [[] for _ in prompts]
    for index, (prompt_len, rows) in enumerate(packed_rows):
        base = index * length
        tokens, positions, segment = list(prompts[rows[0]]), list(range(prompt_len)), [0] * prompt_len
        prompt_positions = list(range(base, base + prompt_len))
        for member, row in enumerate(rows, start=1):
            size, offset = len(completions[row]), len(tokens)
            tokens += completions[row]
            positions += range(prompt_len, prompt_len + size)
            segment += [member] * size
            # Padding reads the row's first position: any real one will do.
            padding = [base] * (time_len - prompt_len - size)
            gather[row] = prompt_positions + list(range(base + offset, base + offset + size)) + padding
        padding = length - len(tokens)
        input_ids.append(tokens + [pad_token_id] * padding)
        position_ids.append(positions + [0] * padding)
        segments.append(segment + [-1] * padding)  # 0: the prompt, j: completion j, -1: padding
    segment = torch.tensor(segments, dtype=torch.long)
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((length, length), dtype=torch.bool).tril()
    allowed = causal & (key != -1) & ((key == 0) | (key == query))
    # Padding queries see themselves only: a fully masked row would make NaNs the backward multiplies by 0.
    allowed |= torch.eye(length, dtype=torch.bool)
    return SharedPrompts(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.tensor(position_ids, dtype=torch.long),
        attention_mask=allowed[:, None],
        gather=torch.tensor(gather, dtype=torch.long),
    )
