"""``MicroBatch``: the right-padded tensors of one forward/backward pass, built from packed samples
(``build_micro_batch``) so that the loss covers exactly the sampled completion tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollflow.messages import Sample
from rollflow.train import routing_replay
from rollflow.train.shared_prompts import SharedPrompts, pack_shared_prompts


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded tensors of one forward/backward pass.

    Logits at position ``t`` predict token ``t + 1``, so every per-token tensor has length ``time - 1`` and
    is aligned with ``target_ids = input_ids[:, 1:]``: index ``i`` describes the token at input position ``i + 1``.
    """

    input_ids: torch.Tensor  # [batch, time] long, padded with pad_token_id
    attention_mask: torch.Tensor  # [batch, time] long, 1 on real tokens
    target_ids: torch.Tensor  # [batch, time - 1] long
    loss_mask: torch.Tensor  # [batch, time - 1] bool, true exactly on the sampled completion tokens
    old_logprobs: torch.Tensor  # [batch, time - 1] float32 behaviour logprobs, 0 off the loss mask
    advantages: torch.Tensor  # [batch, time - 1] float32, the sample's advantage on its loss tokens
    token_versions: (
        torch.Tensor
    )  # [batch, time - 1] long, policy version of each completion token, -1 unknown
    # [batch, time, moe_layers, topk] long expert ids the sampler routed each input token to (-1 unknown), for
    # MoE routing replay; None when no sample carries routes.
    routed_experts: torch.Tensor | None = None
    # [batch, time - 1] long kept count of each completion token (the sampler's top-k/top-p set, 0: nothing
    # cut), for ``trainer.sampling_mask``; None when no sample carries them.
    kept_counts: torch.Tensor | None = None
    # The forward's packed layout when samples share prompts (``shared_prompts.py``); None: run the rows.
    shared_prompts: SharedPrompts | None = None


def build_micro_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    *,
    pad_token_id: int,
    device: torch.device | str = "cpu",
    share_prompts: bool = False,
) -> MicroBatch:
    """Collate samples into one right-padded micro-batch.

    With ``share_prompts``, samples with the same prompt also get the packed layout that runs it once
    (``MicroBatch.shared_prompts``), where that saves enough; only for models ``supports_shared_prompts``.

    With an empty prompt, the first completion token has no logits predicting it and is left out of the loss.
    No samples give one row of two pad tokens without loss tokens: a data-parallel rank with fewer samples
    than the others still runs the pass, and with it the pass's collectives.

    Raises:
        ValueError: a sample's ``logprobs`` and ``completion_token_ids`` differ in length, or it has no tokens.
    """
    for sample in samples:
        if len(sample.logprobs) != len(sample.completion_token_ids):
            raise ValueError(
                f"sample (prompt_index={sample.prompt_index}, sample_index={sample.sample_index}) has "
                f"{len(sample.logprobs)} logprobs for {len(sample.completion_token_ids)} completion tokens; "
                "the sampler must record one logprob per sampled token"
            )
        if sample.loss_mask is not None and len(sample.loss_mask) != len(sample.completion_token_ids):
            raise ValueError(
                f"sample (prompt_index={sample.prompt_index}, sample_index={sample.sample_index}) has a "
                f"loss_mask of {len(sample.loss_mask)} entries for {len(sample.completion_token_ids)} "
                "completion tokens"
            )
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    if min(lengths, default=1) < 1:
        raise ValueError("every sample of a micro-batch needs at least one token")
    time_len = max(lengths, default=2)
    # Rows are built as Python lists and made tensors once: per-row tensor writes cost ~25 us each, which for
    # a step of 128 short samples is milliseconds of the trainer's step.
    ids, attention, loss, behaviour, token_advantages, versions = [], [], [], [], [], []
    for sample, advantage, length in zip(samples, advantages, lengths, strict=True):
        prompt_len, padding = len(sample.prompt_token_ids), time_len - length
        ids.append(sample.prompt_token_ids + sample.completion_token_ids + [pad_token_id] * padding)
        attention.append([1] * length + [0] * padding)
        # Completion token j sits at input position prompt_len + j, predicted from position prompt_len + j - 1.
        first = max(prompt_len - 1, 0)
        skipped = first - (prompt_len - 1)  # 1 when the prompt is empty, else 0
        span = length - 1 - first
        before, after = [0.0] * first, [0.0] * padding
        if sample.loss_mask is None:
            loss.append([False] * first + [True] * span + [False] * padding)
        else:
            loss.append([False] * first + [bool(m) for m in sample.loss_mask[skipped:]] + [False] * padding)
        behaviour.append(before + sample.logprobs[skipped:] + after)
        token_advantages.append(before + [float(advantage)] * span + after)
        if len(sample.policy_versions) == len(sample.completion_token_ids):
            versions.append([-1] * first + sample.policy_versions[skipped:] + [-1] * padding)
        else:
            versions.append([-1] * (time_len - 1))
    if not samples:  # a fully masked row would put NaNs in the (unused) logits
        ids, attention = [[pad_token_id] * time_len], [[1] * time_len]
        loss, behaviour, token_advantages = (
            [[False] * (time_len - 1)],
            [[0.0] * (time_len - 1)],
            [[0.0] * (time_len - 1)],
        )
        versions = [[-1] * (time_len - 1)]
    input_ids = torch.tensor(ids, dtype=torch.long)
    routes = routing_replay.collate_routes(samples, time_len)
    kept_counts = _collate_kept_counts(samples, lengths, time_len)
    shared = None
    if share_prompts and len(samples) > 1:
        shared = pack_shared_prompts(
            [s.prompt_token_ids for s in samples],
            [s.completion_token_ids for s in samples],
            time_len=time_len,
            pad_token_id=pad_token_id,
            groups=[s.prompt_index for s in samples],
        )
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=torch.tensor(attention, dtype=torch.long, device=device),
        target_ids=input_ids[:, 1:].to(device),
        loss_mask=torch.tensor(loss, dtype=torch.bool, device=device),
        old_logprobs=torch.tensor(behaviour, dtype=torch.float32, device=device),
        advantages=torch.tensor(token_advantages, dtype=torch.float32, device=device),
        token_versions=torch.tensor(versions, dtype=torch.long, device=device),
        routed_experts=None if routes is None else routes.to(device),
        kept_counts=None if kept_counts is None else kept_counts.to(device),
        shared_prompts=None if shared is None else shared.to(device),
    )


def _collate_kept_counts(
    samples: Sequence[Sample], lengths: Sequence[int], time_len: int
) -> torch.Tensor | None:
    """``MicroBatch.kept_counts``: each sample's kept counts at its completion positions; None if none has any.

    Raises:
        ValueError: a sample's ``kept_counts`` and ``completion_token_ids`` differ in length.
    """
    if all(sample.kept_counts is None for sample in samples):
        return None
    counts = torch.zeros((len(samples), time_len - 1), dtype=torch.long)
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        if sample.kept_counts is None:
            continue
        if len(sample.kept_counts) != len(sample.completion_token_ids):
            raise ValueError(
                f"sample (prompt_index={sample.prompt_index}, sample_index={sample.sample_index}) has "
                f"{len(sample.kept_counts)} kept counts for {len(sample.completion_token_ids)} completion tokens"
            )
        first = max(len(sample.prompt_token_ids) - 1, 0)
        skipped = first - (len(sample.prompt_token_ids) - 1)
        counts[row, first : length - 1] = torch.tensor(sample.kept_counts[skipped:], dtype=torch.long)
    return counts
