"""The batch packer: turns a step's scored groups into the micro-batches each data-parallel rank trains.

1. Advantages per whole group (``rollflow.train.advantages`` has the maths): the packer sees every group of
   the step, whichever rank its samples land on. Masked samples are left out of the batch.
2. A split of the trainable samples across ranks balanced by tokens: longest first, each to the rank with the
   fewest tokens so far (LPT), which keeps every rank within one sample of the mean.
3. On each rank, micro-batches of samples of similar length (longest first), each within
   ``trainer.micro_batch_size`` samples and, when set, ``trainer.micro_batch_tokens`` padded tokens
   (rows × longest row), so a short sample is never padded to the longest of the step.
4. Every rank gets the same number of micro-batches, topped up with empty ones, so that no rank skips a
   forward/backward pass, and with it a collective, that the others run.

With ``trainer.mini_batches = M`` the step's groups, in batch order, are first cut into M runs of whole
groups (one optimizer update each); steps 2 to 4 then run per mini-batch, so every rank holds the same
number of micro-batches of each mini-batch (``RankBatch.mini_batch_sizes``) and takes the same updates.

Pure Python: no torch, so it runs anywhere the orchestrator does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from rollflow.config import TrainerConfig
from rollflow.messages import PackedBatch, RankBatch, Sample, TrainBatch, TrainSample
from rollflow.train.advantages import AdvantageMethod, compute_advantages


def pack_batch(
    batch: TrainBatch,
    *,
    num_ranks: int = 1,
    advantage: AdvantageMethod = "grpo",
    micro_batch_size: int = 64,
    micro_batch_tokens: int | None = None,
    mini_batches: int = 1,
) -> PackedBatch:
    """Advantages per group, then the step's trainable samples split across ``num_ranks`` ranks.

    Args:
        batch: the step's scored groups.
        num_ranks: data-parallel ranks of the trainer (``trainer.num_workers``).
        advantage: the baseline (``trainer.advantage``).
        micro_batch_size: most samples per micro-batch (``trainer.micro_batch_size``).
        micro_batch_tokens: most padded tokens (rows × longest row) per micro-batch
            (``trainer.micro_batch_tokens``); None: no token budget.
        mini_batches: optimizer updates per pass over the batch (``trainer.mini_batches``): the groups,
            in order, are cut into this many runs of equally many whole groups.

    Raises:
        ValueError: a trainable sample is longer than ``micro_batch_tokens``, has no tokens, or its logprobs
            or loss mask do not match its completion tokens; ``mini_batches`` does not divide the groups.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks}: a trainer has at least one rank")
    num_groups = len(batch.groups)
    if mini_batches < 1 or num_groups % mini_batches:
        raise ValueError(
            f"trainer.mini_batches = {mini_batches} does not divide the {num_groups} prompt groups of step "
            f"{batch.step}: mini-batches are whole groups; set trainer.mini_batches to a divisor of "
            "orchestrator.prompts_per_step"
        )
    groups_per_mini_batch = num_groups // mini_batches
    trainable: list[list[TrainSample]] = [[] for _ in range(mini_batches)]
    num_samples = num_masked = 0
    for group_index, group in enumerate(batch.groups):
        samples = group.samples
        advantages = compute_advantages(
            [s.reward for s in samples],
            [not s.masked for s in samples],
            advantage,
            trajectories=[s.trajectory for s in samples],
        )
        num_samples += len(samples)
        for sample, value in zip(samples, advantages, strict=True):
            if sample.masked:
                num_masked += 1
                continue
            check_sample(sample, micro_batch_tokens)
            trainable[group_index // groups_per_mini_batch].append(
                TrainSample(sample=sample, advantage=value)
            )

    micro_batches: list[list[list[TrainSample]]] = [[] for _ in range(num_ranks)]
    mini_batch_sizes: list[int] = []
    rank_tokens = [0] * num_ranks
    for items in trainable:
        per_rank = split_by_tokens(items, num_ranks)
        runs = [micro_batches_by_length(share, micro_batch_size, micro_batch_tokens) for share in per_rank]
        # Every rank runs as many passes in each update (empty ones included): the same collectives.
        count = max(len(rank) for rank in runs)
        mini_batch_sizes.append(count)
        for rank, (run, share) in enumerate(zip(runs, per_rank, strict=True)):
            micro_batches[rank] += run + [[] for _ in range(count - len(run))]
            rank_tokens[rank] += sum(sample_length(item.sample) for item in share)

    every_sample = [item for items in trainable for item in items]
    mean_tokens = sum(rank_tokens) / num_ranks
    metrics = {
        "num_samples": float(num_samples),
        "num_masked_samples": float(num_masked),
        "advantage_abs_mean": math.fsum(abs(item.advantage) for item in every_sample) / len(every_sample)
        if every_sample
        else 0.0,
        "num_micro_batches": float(sum(mini_batch_sizes)),
        # Most tokens on one rank over the mean: 1.0 is a perfect split; the step waits for the largest.
        "rank_token_imbalance": max(rank_tokens) / mean_tokens if mean_tokens else 1.0,
    }
    # One mini-batch needs no sizes (RankBatch's default: all the micro-batches).
    sizes = mini_batch_sizes if mini_batches > 1 else []
    return PackedBatch(
        step=batch.step,
        ranks=[
            RankBatch(step=batch.step, micro_batches=rank, mini_batch_sizes=list(sizes))
            for rank in micro_batches
        ],
        metrics=metrics,
    )


def pack_for_trainer(batch: TrainBatch, config: TrainerConfig, num_ranks: int = 1) -> PackedBatch:
    """``pack_batch`` with the settings of ``config`` (the ``[trainer]`` section)."""
    return pack_batch(
        batch,
        num_ranks=num_ranks,
        advantage=config.advantage,
        micro_batch_size=config.micro_batch_size,
        micro_batch_tokens=config.micro_batch_tokens,
        mini_batches=config.mini_batches,
    )


def sample_length(sample: Sample) -> int:
    """Tokens of the sample's trainer input: prompt and completion."""
    return len(sample.prompt_token_ids) + len(sample.completion_token_ids)


def loss_token_count(sample: Sample) -> int:
    """Completion tokens trained on: the loss mask's, less the first one after an empty prompt (no logits
    predict it; see ``rollflow.train.trainer.build_micro_batch``)."""
    skipped = 0 if sample.prompt_token_ids else 1
    if sample.loss_mask is None:
        return max(len(sample.completion_token_ids) - skipped, 0)
    return sum(sample.loss_mask[skipped:])


def check_sample(sample: Sample, micro_batch_tokens: int | None = None) -> None:
    """The checks the trainer's collation makes, made here so that a bad sample fails the step before any
    rank starts it (a rank that raises mid-step would leave the others waiting in a collective).

    Raises:
        ValueError: see ``pack_batch``.
    """
    where = f"sample (prompt_index={sample.prompt_index}, sample_index={sample.sample_index})"
    if len(sample.logprobs) != len(sample.completion_token_ids):
        raise ValueError(
            f"{where} has {len(sample.logprobs)} logprobs for {len(sample.completion_token_ids)} completion "
            "tokens; the sampler must record one logprob per sampled token"
        )
    if sample.loss_mask is not None and len(sample.loss_mask) != len(sample.completion_token_ids):
        raise ValueError(
            f"{where} has a loss_mask of {len(sample.loss_mask)} entries for "
            f"{len(sample.completion_token_ids)} completion tokens"
        )
    length = sample_length(sample)
    if length < 1:
        raise ValueError(f"{where} has no tokens; every trained sample needs at least one")
    if micro_batch_tokens is not None and length > micro_batch_tokens:
        raise ValueError(
            f"trainer.micro_batch_tokens = {micro_batch_tokens} is smaller than {where}, which has {length} "
            f"tokens (prompt and completion): no micro-batch can hold it; raise trainer.micro_batch_tokens "
            f"to at least the longest sample (inference.max_model_len bounds single-turn samples)"
        )


def split_by_tokens(items: Sequence[TrainSample], num_ranks: int) -> list[list[TrainSample]]:
    """Longest first, each sample to the rank with the fewest tokens so far (ties: the lowest rank).

    Deterministic: the same samples give the same split.
    """
    ordered = sorted(items, key=_longest_first)
    loads = [(0, rank) for rank in range(num_ranks)]
    ranks: list[list[TrainSample]] = [[] for _ in range(num_ranks)]
    for item in ordered:
        tokens, rank = heapq.heappop(loads)
        ranks[rank].append(item)
        heapq.heappush(loads, (tokens + sample_length(item.sample), rank))
    return ranks


def micro_batches_by_length(
    items: Sequence[TrainSample], micro_batch_size: int, micro_batch_tokens: int | None
) -> list[list[TrainSample]]:
    """Consecutive runs of the samples sorted longest first, each within both budgets (the first sample of a
    run is its longest, so the run's padded size is ``len(run) * length(run[0])``)."""
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    for item in sorted(items, key=_longest_first):
        if current:
            rows = len(current) + 1
            over_tokens = micro_batch_tokens is not None and rows * sample_length(current[0].sample) > (
                micro_batch_tokens
            )
            if rows > micro_batch_size or over_tokens:
                batches.append(current)
                current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


def _longest_first(item: TrainSample) -> tuple[int, int, int]:
    return (-sample_length(item.sample), item.sample.prompt_index, item.sample.sample_index)
