"""Every message that crosses a channel or a process boundary.

Messages are msgspec Structs: cheap to build, typed, and encodable as JSON or msgpack unchanged. They hold
plain Python data (lists of ints and floats), never tensors, so they can cross processes later.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class FinishReason(enum.Enum):
    """Why a generation ended. The string values are part of the external (vLLM-compatible) API."""

    STOP = "stop"  # a stop token was sampled
    LENGTH = "length"  # max_tokens or the model's context length was reached
    ABORT = "abort"  # the request was aborted (e.g. by a pause in abort mode); partial tokens are kept


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling settings of one request (vLLM's names and meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k filtering, as in vLLM.
    top_k: int = -1
    # Per-request seed: the same seed, prompt and weights give the same tokens.
    seed: int | None = None
    # Token ids that end the generation; the stop token itself is part of the output.
    stop_token_ids: tuple[int, ...] = ()


class GenerateRequest(msgspec.Struct, frozen=True):
    """Token-in generation request to an inference engine."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str = ""
    # Routes all calls of one agent session to one server (prefix-cache affinity); unused in-process.
    session_id: str | None = None


class GenerateOutput(msgspec.Struct):
    """Token-out result: what was sampled, with the logprob and policy version of each token."""

    request_id: str
    token_ids: list[int]
    # log p(token) under the sampling distribution after temperature, before top-k/top-p filtering.
    logprobs: list[float]
    finish_reason: FinishReason
    # Policy version that produced each token; differs within one output only if weights changed mid-request.
    policy_versions: list[int]
    prompt_len: int = 0
    # MoE routing replay: the top-k expert ids of every token the engine ran, a numpy integer array
    # [prompt_len + len(token_ids) - 1, moe_layers, topk] (the last sampled token is never run), or None when
    # the engine does not return them. Encode it with ``rollflow.inference.routed_experts.pack_routed_experts``.
    routed_experts: Any = None


class GenerateChunk(msgspec.Struct):
    """One piece of a streamed generation: the tokens sampled since the previous chunk, with their logprobs
    and policy versions. The last chunk of a stream has ``finish_reason`` set (and may carry tokens too);
    concatenating every chunk gives exactly the ``GenerateOutput`` a non-streamed call returns."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    # None until the last chunk.
    finish_reason: FinishReason | None = None
    prompt_len: int = 0
    # The whole output's ``GenerateOutput.routed_experts``, on the last chunk only (routes are per token run,
    # including prompt tokens, so they do not split by chunk).
    routed_experts: Any = None


class RolloutRequest(msgspec.Struct, frozen=True):
    """One prompt admitted for generation: the data source's unit of work."""

    prompt_index: int  # position in the data stream; checkpoints resume from here
    messages: list[dict[str, Any]]
    answer: Any = None
    metadata: dict[str, Any] = {}
    num_samples: int = 1


class Sample(msgspec.Struct):
    """One sampled completion with everything the trainer needs, token-exact."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    # Per completion token: True where the token was sampled and is trained on. None means every completion
    # token was sampled (single turn); multi-turn samples mark tool and user tokens between turns False.
    loss_mask: list[bool] | None = None
    completion_text: str = ""
    reward: float = 0.0
    # Masked samples take no part in the loss nor in their group's baseline.
    masked: bool = False
    # Why the sample was masked (e.g. "reward_error"), for metrics.
    mask_reason: str | None = None
    # The agent trajectory (within its group) the sample was composed from: samples of one trajectory count
    # once in the group's baseline. None: the sample is a trajectory of its own (single turn).
    trajectory: int | None = None

    @property
    def min_policy_version(self) -> int:
        return min(self.policy_versions) if self.policy_versions else -1


class ScoredGroup(msgspec.Struct):
    """All samples of one prompt, with rewards: the unit the advantage baseline is computed over."""

    prompt_index: int
    samples: list[Sample]
    generation_time_s: float = 0.0
    # Generator counts for this group (agent rollouts: branches, render outcomes, errors, timeouts).
    metrics: dict[str, float] = {}


class TrainBatch(msgspec.Struct):
    """The groups one optimizer step trains on."""

    step: int
    groups: list[ScoredGroup]

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group.samples]


class StepResult(msgspec.Struct):
    """What a train step reports back: its metrics and whether the weights changed."""

    step: int
    metrics: dict[str, float]
    # False when the update was skipped (non-finite loss, nothing trainable): no weight push is needed.
    updated: bool = True


class TrainSample(msgspec.Struct):
    """A sample as the trainer trains it: with the advantage its group's baseline gave it."""

    sample: Sample
    advantage: float


class RankBatch(msgspec.Struct):
    """One data-parallel rank's share of a step: its micro-batches, one forward/backward pass each.

    Every rank of a step gets the same number of micro-batches; an empty one carries no loss tokens (the rank
    still runs it, so it joins every collective of the pass).
    """

    step: int
    micro_batches: list[list[TrainSample]]

    @property
    def samples(self) -> list[Sample]:
        return [item.sample for micro_batch in self.micro_batches for item in micro_batch]


class PackedBatch(msgspec.Struct):
    """A step's trainable samples with their advantages, split across data-parallel ranks by tokens
    (``rollflow.orchestrator.packing``); masked samples are left out."""

    step: int
    ranks: list[RankBatch]
    # Step-wide figures the packer measured (samples, masked samples, mean |advantage|, tokens per rank).
    metrics: dict[str, float] = {}

    @property
    def samples(self) -> list[Sample]:
        """The trained samples of every rank."""
        return [sample for rank in self.ranks for sample in rank.samples]
