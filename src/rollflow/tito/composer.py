"""Turn a sealed ``Trace`` into training samples.

Modes:
- ``per_branch``: one sample per branch (root-to-leaf path). A sampled node shared by several branches
  (the turns before a history rewrite) is trained once, in the *first* branch that contains it (branches in
  the order their leaves were created, so the branch that continued first); elsewhere its tokens are context
  (loss mask False, logprob 0.0). A branch left with nothing to train is not emitted.
- ``single_branch``: one sample for the trajectory. A trace without exactly one branch is masked
  (``mask_reason="not_single_branch"``): its turns cannot be trained as one sequence.
- ``step_wise``: one sample per model call: the prompt it saw and the tokens it sampled.

Side calls' replies (``rollflow.tito.side_calls``) are never trained: a branch of side calls only is not
emitted, and where a side call's reply is in a trained branch's history it is context.

Every sample gets the trajectory's reward. Masking: an agent error masks every sample (``"error"``, counted as
an error); an agent timeout masks them as ``"timeout"`` (not an error). A sample longer than ``max_seq_len``
is masked as ``"overlong"`` with ``filter_overlong=True``, otherwise its completion is cut to fit (its
prompt alone too long: masked either way). Masked samples must not enter the loss nor the group baseline.

Users plug in their own composer by import path (``resolve_composer("pkg.mod:fn")``); it is called like
``compose`` and returns ``Sample``s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

from rollflow.errors import RoutedExpertsError
from rollflow.imports import import_object
from rollflow.messages import FinishReason, Sample
from rollflow.tito.trace import Node, Trace

ComposeMode = Literal["per_branch", "single_branch", "step_wise"]
COMPOSE_MODES: tuple[str, ...] = ("per_branch", "single_branch", "step_wise")


class TITOSample(Sample):
    """A ``Sample`` composed from a TITO trace; its ``routed_experts`` (when the engine reported them) is an
    int32 array with one row per token, ``[len(prompt) + len(completion), layers, topk]``."""


class Composer(Protocol):
    def __call__(
        self,
        trace: Trace,
        *,
        reward: float,
        mode: str,
        max_seq_len: int,
        filter_overlong: bool = False,
        prompt_index: int = 0,
    ) -> list[Sample]: ...


def compose(
    trace: Trace,
    *,
    reward: float,
    mode: ComposeMode = "per_branch",
    max_seq_len: int,
    filter_overlong: bool = False,
    prompt_index: int = 0,
) -> list[TITOSample]:
    """Training samples from a trace (see the module docstring for modes and masking).

    Raises:
        ValueError: unknown ``mode`` or ``max_seq_len`` < 1.
        RoutedExpertsError: the nodes of one sample carry routed experts of different shapes.
    """
    if mode not in COMPOSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPOSE_MODES)}, got {mode!r}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    side = trace.side_nodes  # side calls' replies: context where a branch holds them, never trained
    if mode == "step_wise":
        rows = [(node.path(), {node.id}) for node in trace.nodes if node.sampled and node.id not in side]
    else:
        rows = []
        trained_before: set[int] = set(side)
        for path in trace.branches():
            trainable = {node.id for node in path if node.sampled and node.id not in trained_before}
            trained_before |= trainable
            if trainable:
                rows.append((path, trainable))
    samples = [_sample(path, trained, step_wise=mode == "step_wise") for path, trained in rows]
    if mode == "single_branch" and len(samples) != 1:
        samples = [_mask(samples[-1] if samples else _empty_sample(), "not_single_branch")]
    for index, sample in enumerate(samples):
        sample.prompt_index = prompt_index
        sample.sample_index = index
        sample.reward = reward
    return [_finalize(sample, trace, max_seq_len, filter_overlong) for sample in samples]


def _sample(path: list[Node], trained: set[int], *, step_wise: bool) -> TITOSample:
    """One row over ``path``; sampled tokens of the ``trained`` nodes are trainable. In step-wise rows the
    path ends at the trained node and the completion is just its sampled tokens."""
    token_ids: list[int] = []
    loss_mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    kept_counts: list[int] = []  # 0 where nothing was cut, and on tokens that were not sampled
    for node in path:
        tokens = node.token_ids.tolist()
        token_ids += tokens
        if node.id in trained:
            loss_mask += node.sampled_mask
            logprobs += [0.0] * node.num_prompt + node.logprobs.tolist()
            versions += [-1] * node.num_prompt + node.policy_versions.tolist()
            node_counts = node.kept_counts
            sampled_counts = (
                node_counts.tolist() if node_counts is not None else [0] * (len(tokens) - node.num_prompt)
            )
            kept_counts += [0] * node.num_prompt + sampled_counts
        else:
            loss_mask += [False] * len(tokens)
            logprobs += [0.0] * len(tokens)
            versions += [-1] * len(tokens)
            kept_counts += [0] * len(tokens)
    split = loss_mask.index(True) if True in loss_mask else len(token_ids)
    if step_wise:
        split = len(token_ids) - (len(path[-1].token_ids) - path[-1].num_prompt)
    last = path[-1]
    finish = FinishReason(last.finish_reason) if last.finish_reason else FinishReason.STOP
    completion_mask = loss_mask[split:]
    # Context tokens inside the completion get the oldest trained version, so staleness stays right.
    trained_versions = [v for v, m in zip(versions[split:], completion_mask, strict=True) if m]
    fill = min(trained_versions, default=-1)
    return TITOSample(
        prompt_index=0,
        sample_index=0,
        prompt_token_ids=token_ids[:split],
        completion_token_ids=token_ids[split:],
        logprobs=logprobs[split:],
        policy_versions=[v if m else fill for v, m in zip(versions[split:], completion_mask, strict=True)],
        finish_reason=finish,
        loss_mask=completion_mask,
        completion_text=str(last.message.get("content", "")) if last.message else "",
        routed_experts=_experts(path),
        kept_counts=kept_counts[split:] if any(kept_counts[split:]) else None,
    )


def _experts(path: list[Node]) -> Any:
    if not path or any(node.routed_experts is None for node in path):
        return None
    import numpy as np

    shapes = {node.routed_experts.shape[1:] for node in path}
    if len(shapes) != 1:
        raise RoutedExpertsError(
            f"routed experts of one branch have different [layers, topk]: {sorted(shapes)}"
        )
    experts = np.concatenate([node.routed_experts for node in path], axis=0).astype(np.int32, copy=False)
    assert experts.shape[0] == sum(len(node.token_ids) for node in path)
    return experts


def _empty_sample() -> TITOSample:
    return TITOSample(
        prompt_index=0,
        sample_index=0,
        prompt_token_ids=[],
        completion_token_ids=[],
        logprobs=[],
        policy_versions=[],
        finish_reason=FinishReason.ABORT,
        loss_mask=[],
    )


def _mask(sample: TITOSample, reason: str) -> TITOSample:
    sample.masked = True
    sample.mask_reason = reason
    return sample


def _finalize(sample: TITOSample, trace: Trace, max_seq_len: int, filter_overlong: bool) -> TITOSample:
    # Precedence: timeout, then error, then length; the first reason is the one counted.
    if trace.timed_out:
        return _mask(sample, "timeout")
    if trace.error is not None or trace.errors:
        return _mask(sample, "error")
    if sample.masked:
        return sample
    total = len(sample.prompt_token_ids) + len(sample.completion_token_ids)
    if total > max_seq_len:
        if filter_overlong or len(sample.prompt_token_ids) >= max_seq_len:
            return _mask(sample, "overlong")
        keep = max_seq_len - len(sample.prompt_token_ids)
        sample.completion_token_ids = sample.completion_token_ids[:keep]
        sample.logprobs = sample.logprobs[:keep]
        sample.policy_versions = sample.policy_versions[:keep]
        sample.loss_mask = sample.loss_mask[:keep]
        if sample.kept_counts is not None:
            sample.kept_counts = sample.kept_counts[:keep]
        sample.finish_reason = FinishReason.LENGTH
        if sample.routed_experts is not None:
            sample.routed_experts = sample.routed_experts[:max_seq_len]
    elif trace.stats.context_exceeded and filter_overlong:
        return _mask(sample, "overlong")
    return sample


def resolve_composer(spec: str | Callable[..., list[Sample]] | None) -> Callable[..., list[Sample]]:
    """``None`` or ``"default"``: ``compose``; a callable: itself; ``"pkg.mod:fn"``: that function.

    Raises:
        ConfigError: the import path does not resolve to a callable.
    """
    if spec is None or spec == "default":
        return compose
    if callable(spec):
        return spec
    return import_object(spec, key="composer")


def trace_metrics(trace: Trace, samples: list[Sample]) -> dict[str, float]:
    """Per-trajectory counts for metrics: branches, render outcomes, and why samples were masked."""
    reasons = [s.mask_reason for s in samples if s.masked]
    return {
        "num_turns": float(trace.stats.turns),
        "num_branches": float(len(trace.leaves())),
        "num_bridged_turns": float(trace.stats.bridged),
        "num_full_render_turns": float(trace.stats.full_render),
        "num_forked_turns": float(trace.stats.forked),
        "num_replayed_requests": float(trace.stats.replayed),
        "num_context_exceeded": float(trace.stats.context_exceeded),
        "num_sampling_overridden": float(trace.stats.sampling_overridden),
        "num_streams_diverged": float(trace.stats.streams_diverged),
        "num_unknown_fields": float(trace.stats.unknown_fields),
        "num_ignored_values": float(trace.stats.ignored_values),
        "num_side_calls": float(trace.stats.side_calls),
        **{f"num_side_calls_{kind}": float(count) for kind, count in trace.side_calls.items()},
        "is_error": float(trace.error is not None or bool(trace.errors)) * float(not trace.timed_out),
        "is_timeout": float(trace.timed_out),
        "num_masked_samples": float(len(reasons)),
        "num_overlong_samples": float(reasons.count("overlong")),
    }
