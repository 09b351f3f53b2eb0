"""Every message that crosses a channel or a process boundary.

Messages are msgspec Structs: cheap to build, typed, and encodable as JSON or msgpack unchanged. They hold
plain Python data (lists of ints and floats), never tensors, so they can cross processes later.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

import msgspec


class FinishReason(enum.Enum):
    """Why a generation ended. The string values are part of the external (vLLM-compatible) API."""

    STOP = "stop"  # a stop token was sampled
    LENGTH = "length"  # max_tokens or the model's context length was reached
    ABORT = "abort"  # the request was aborted (e.g. by a pause in abort mode); partial tokens are kept


# Bounds every sampler input is checked against (engine, server, config), so that float32 sampling stays
# finite. A temperature is 0 (greedy) or within [MIN_TEMPERATURE, MAX_TEMPERATURE]: below 1e-5 (vLLM's
# _SAMPLING_EPS, under which vLLM switches to greedy) any two logits 1e-4 apart already differ by 10 nats, so
# the draw is argmax in all but name, and much smaller values round to 0 or a denormal in float32 (0 / 0 is
# NaN). rollflow refuses rather than switching to greedy, because the reported logprob would then not be the
# one the trainer recomputes at that temperature. Above 1e4 logits spanning 100 differ by at most 0.01 nats:
# uniform sampling in all but name, and a likely typo.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4
# top_p keeps the smallest prefix of tokens whose mass reaches it; the most likely token alone always has mass
# >= 1 / vocab_size > 1e-8, so every top_p below 1e-8 selects the same single token (use top_k = 1 for that),
# and values below float32's smallest normal (~1.2e-38) round to a denormal or to 0, which keeps nothing.
MIN_TOP_P = 1e-8
# Integers crossing into torch (seeds, top_k) must fit in int64.
_INT64 = 2**63


def _is_integer(value: Any) -> bool:
    """An integer that is not a bool. Plain ints are checked by type first: ``isinstance`` against the
    ``numbers`` ABCs walks every registered subclass whenever some ABC registration has reset their caches,
    tens of microseconds on the per-request path."""
    return type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Integral))


def _is_real(value: Any) -> bool:
    """A real number that is not a bool (plain floats and ints checked by type first, as in ``_is_integer``)."""
    return (
        type(value) is float
        or type(value) is int
        or (not isinstance(value, bool) and isinstance(value, numbers.Real))
    )


def sampling_error(
    *, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any = None
) -> tuple[str, str] | None:
    """The first sampling value an engine cannot honour, as ``(field, message)``; None when all are fine.

    ``message`` names the field, the value and the allowed range. Shared by the engine, its HTTP server and
    the run config, so the three agree on what a sampler accepts. No torch here.
    """
    if not _is_integer(max_tokens) or max_tokens < 1:
        return "max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens!r}"
    if (
        not _is_real(temperature)
        or not math.isfinite(temperature)
        or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)
    ):
        return (
            "temperature",
            f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got "
            f"{temperature!r}: below {MIN_TEMPERATURE:g} the float32 sampler is argmax in all but name (and "
            f"tiny values round to 0), above {MAX_TEMPERATURE:g} it is uniform in all but name; use 0 for greedy",
        )
    if not _is_real(top_p) or not math.isfinite(top_p) or not MIN_TOP_P <= top_p <= 1:
        return (
            "top_p",
            f"top_p must be in [{MIN_TOP_P:g}, 1] (1 disables it), got {top_p!r}; every top_p below "
            f"{MIN_TOP_P:g} keeps only the most likely token: use top_k = 1 for that",
        )
    if not _is_integer(top_k) or not -1 <= top_k < _INT64:
        return "top_k", f"top_k must be -1 or 0 (disabled) or a positive integer, got {top_k!r}"
    if seed is not None and (not _is_integer(seed) or not 0 <= seed < _INT64):
        return "seed", f"seed must be an integer in [0, 2**63), got {seed!r}"
    return None


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling settings of one request (vLLM's names and meanings); ``sampling_error`` says what is valid."""

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
    # log p(token) under the distribution it was drawn from: after temperature, renormalised over the tokens
    # top-k/top-p kept (vLLM's processed logprobs); see ``kept_counts``.
    logprobs: list[float]
    finish_reason: FinishReason
    # Policy version that produced each token; differs within one output only if weights changed mid-request.
    policy_versions: list[int]
    prompt_len: int = 0
    # MoE routing replay: the top-k expert ids of every token the engine ran, a numpy integer array
    # [prompt_len + len(token_ids) - 1, moe_layers, topk] (the last sampled token is never run), or None when
    # the engine does not return them. Encode it with ``rollflow.inference.routed_experts.pack_routed_experts``.
    routed_experts: Any = None
    # Sampling mask, one int per token: the sampler kept the n most likely tokens (scaled logits in descending
    # order, ties to the lower token id) and drew from those; 0 for a token drawn from the whole vocabulary.
    # None: no token was cut (no top-k/top-p), or the engine does not record it (vLLM).
    kept_counts: list[int] | None = None


def join_kept_counts(pieces: list[tuple[int, list[int] | None]]) -> list[int] | None:
    """The kept counts of consecutive pieces of ``(token count, kept counts or None)``: None if no piece
    has any, else one list with 0 for the tokens of pieces without."""
    if all(not counts for _, counts in pieces):
        return None
    joined: list[int] = []
    for length, counts in pieces:
        joined += counts if counts else [0] * length
    return joined


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
    # ``GenerateOutput.kept_counts`` of this chunk's tokens; None: none of them was cut.
    kept_counts: list[int] | None = None


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
    # Per completion token, the sampler's kept count (``GenerateOutput.kept_counts``; 0 where nothing was cut
    # and on tokens that were not sampled); None: no token was cut. The trainer replays it
    # (``trainer.sampling_mask``).
    kept_counts: list[int] | None = None
    # MoE routing replay: the top-k expert ids of the sample's tokens as the engine routed them, a numpy integer
    # array [len(prompt) + len(completion) (or one fewer: the last sampled token never ran), moe_layers, topk];
    # None when the engine returned none. The trainer replays them (``rollflow.train.routing_replay``).
    routed_experts: Any = None

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


# ---------------------------------------------------------------- one training step between its stages
# (rollflow.orchestrator.pipeline): batch wanted ▸ batch ready ▸ step trained ▸ version published.


class BatchWanted(msgspec.Struct, frozen=True):
    """The run asks the batcher for the groups of one more step (sent once the previous step is complete,
    so a batch is never collected, and checked for staleness, against weights about to change)."""

    step: int


class BatchReady(msgspec.Struct):
    """A step's groups, checked against the staleness bound: the trainer stage's input."""

    batch: TrainBatch
    # The policy version the batch trains on (the weights the engines hold while it is trained).
    policy_version: int
    # Seconds the batcher waited for the groups (the trainer's wait for generation).
    collect_time_s: float = 0.0
    # Groups beyond the staleness bound, dropped and queued for regeneration.
    dropped_stale_groups: int = 0
    # Per trained sample, policy versions behind the weights it trains on.
    staleness: list[int] = []


class StepTrained(msgspec.Struct):
    """A step the trainer took: the barrier stage's input."""

    ready: BatchReady
    result: StepResult
    # Seconds the servers took to go to sleep before the step (inference.colocate), else 0.
    sleep_time_s: float = 0.0


class VersionPublished(msgspec.Struct):
    """The barrier's output: the step is complete and the engines hold ``policy_version``; generation
    admission (``StalenessSchedule.published``) moves on from it."""

    trained: StepTrained
    policy_version: int
    # The barrier's timings in seconds (barrier_time_s, pause_time_s, transfer_time_s, wake_time_s).
    barrier: dict[str, float] = {}
    # Fraction of the train-and-barrier time during which some group was generating (0 in sync mode).
    overlap_fraction: float = 0.0


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
    # Micro-batches of each mini-batch (one optimizer update each, ``trainer.mini_batches``), in order:
    # consecutive runs of ``micro_batches``, the same on every rank. Empty: one mini-batch of them all.
    mini_batch_sizes: list[int] = []

    @property
    def samples(self) -> list[Sample]:
        return [item.sample for micro_batch in self.micro_batches for item in micro_batch]

    def mini_batch_slices(self) -> list[range]:
        """Indices into ``micro_batches`` of each mini-batch, in update order.

        Raises:
            ValueError: ``mini_batch_sizes`` do not add up to the micro-batches.
        """
        sizes = self.mini_batch_sizes or [len(self.micro_batches)]
        if any(size < 0 for size in sizes) or sum(sizes) != len(self.micro_batches):
            raise ValueError(
                f"step {self.step}: mini_batch_sizes {sizes} do not split its {len(self.micro_batches)} "
                "micro-batches; pack the step with rollflow.orchestrator.packing.pack_batch"
            )
        starts = [sum(sizes[:index]) for index in range(len(sizes))]
        return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


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


# ---------------------------------------------------------------- TITO proxy workers (rollflow.tito.workers)
# The link between the run's process and one proxy worker process: msgpack frames over a socket pair. The
# worker serves its agents' sessions and asks the run's inference client for every generation; the run opens
# and closes sessions on it and gets each closed session's trace back.


class WorkerSetup(msgspec.Struct, tag="setup", array_like=True):
    """Run -> worker, first: the pickled ``(renderer, tokenizer, TITOProxy keyword arguments)``; ``streams``:
    the run's client streams (``generate_stream``)."""

    payload: bytes
    streams: bool


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    """Worker -> run: its proxy listens at ``base_url``."""

    base_url: str


class WorkerGenerate(msgspec.Struct, tag="generate", array_like=True):
    """Worker -> run: generate ``request``; answered by ``WorkerOutput`` or ``WorkerFailure`` with ``id``."""

    id: int
    request: GenerateRequest


class WorkerStream(msgspec.Struct, tag="stream", array_like=True):
    """Worker -> run: stream ``request``; answered by ``WorkerChunk``s with ``id`` (the last one has its
    ``finish_reason`` set) or a ``WorkerFailure``."""

    id: int
    request: GenerateRequest


class WorkerChunk(msgspec.Struct, tag="chunk", array_like=True):
    id: int
    chunk: GenerateChunk


class WorkerCancel(msgspec.Struct, tag="cancel", array_like=True):
    """Worker -> run: the caller of generate or stream ``id`` left (its agent disconnected, its session
    closed, a stop string ended the stream)."""

    id: int


class WorkerOutput(msgspec.Struct, tag="output", array_like=True):
    id: int
    output: GenerateOutput


class WorkerFailure(msgspec.Struct, tag="failure", array_like=True):
    """Run -> worker: generate ``id`` raised; ``kind`` names the inference error family it belongs to
    (``request``, ``dead``, ``unavailable`` or ``other``), rebuilt on the worker's side."""

    id: int
    kind: str
    message: str
    code: str
    param: str | None
    http_status: int


class WorkerOpen(msgspec.Struct, tag="open", array_like=True):
    """Run -> worker: open session ``session_id``; answered by ``WorkerOpened`` with ``call``."""

    call: int
    session_id: str


class WorkerOpened(msgspec.Struct, tag="opened", array_like=True):
    """The session's base URL, or why it could not be opened."""

    call: int
    base_url: str
    error: str | None = None


class WorkerClose(msgspec.Struct, tag="close", array_like=True):
    """Run -> worker: close session ``session_id`` (``TITOProxy.close_session``); answered by ``WorkerClosed``."""

    call: int
    session_id: str
    error: str | None
    timed_out: bool
    drain_timeout_s: float | None


class WorkerClosed(msgspec.Struct, tag="closed", array_like=True):
    """The closed session's pickled ``Trace``, or why it could not be closed."""

    call: int
    trace: bytes
    error: str | None = None


WorkerMessage = (
    WorkerSetup
    | WorkerReady
    | WorkerGenerate
    | WorkerStream
    | WorkerChunk
    | WorkerCancel
    | WorkerOutput
    | WorkerFailure
    | WorkerOpen
    | WorkerOpened
    | WorkerClose
    | WorkerClosed
)
