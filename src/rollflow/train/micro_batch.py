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
    batch, time_len = max(len(samples), 1), max(lengths, default=2)
    input_ids = torch.full((batch, time_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, time_len), dtype=torch.long)
    if not samples:
        attention_mask[:] = 1  # a fully masked row would put NaNs in the (unused) logits
    loss_mask = torch.zeros((batch, time_len - 1), dtype=torch.bool)
    old_logprobs = torch.zeros((batch, time_len - 1), dtype=torch.float32)
    token_advantages = torch.zeros((batch, time_len - 1), dtype=torch.float32)
    token_versions = torch.full((batch, time_len - 1), -1, dtype=torch.long)
    routes = routing_replay.collate_routes(samples, time_len)
    kept_counts = _collate_kept_counts(samples, lengths, time_len)
    shared = None
    if share_prompts and len(samples) > 1:
        shared = pack_shared_prompts(
            [s.prompt_token_ids for s in samples],
            [s.completion_token_ids for s in samples],
            time_len=time_len,
            pad_token_id=pad_token_id,
        )
    for row, (sample, advantage, length) in enumerate(zip(samples, advantages, lengths, strict=True)):
        prompt_len = len(sample.prompt_token_ids)
        input_ids[row, :length] = torch.tensor(sample.prompt_token_ids + sample.completion_token_ids)
        attention_mask[row, :length] = 1
        # Completion token j sits at input position prompt_len + j, predicted from position prompt_len + j - 1.
        first = max(prompt_len - 1, 0)
        skipped = first - (prompt_len - 1)  # 1 when the prompt is empty, else 0
        if sample.loss_mask is None:
            loss_mask[row, first : length - 1] = True
        else:
            loss_mask[row, first : length - 1] = torch.tensor(sample.loss_mask[skipped:], dtype=torch.bool)
        old_logprobs[row, first : length - 1] = torch.tensor(sample.logprobs[skipped:], dtype=torch.float32)
        token_advantages[row, first : length - 1] = advantage
        if len(sample.policy_versions) == len(sample.completion_token_ids):
            token_versions[row, first : length - 1] = torch.tensor(sample.policy_versions[skipped:])
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        target_ids=input_ids[:, 1:].to(device),
        loss_mask=loss_mask.to(device),
        old_logprobs=old_logprobs.to(device),
        advantages=token_advantages.to(device),
        token_versions=token_versions.to(device),
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
