"""Wire types and errors of the engine server: the request bodies of the vLLM 0.33 endpoints it implements.

Bodies are decoded straight into these Structs (``decode_body``), so a wrong type or a missing field becomes a
400 naming the field (``$.sampling_params.max_tokens``). Unknown fields are ignored, as vLLM does, because
OpenAI clients send fields the engine has no use for (``user``). Fields the torch engine
cannot honour are decoded anyway and rejected by the handlers with a message that names them.

No torch here: only the wire.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec
from aiohttp import web

from rollflow.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ENGINE_DEAD,
    ENGINE_DEAD_TYPE,
    InferenceError,
)
from rollflow.errors import error_body as _error_body

# ------------------------------------------------------------------ errors


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    type_: str | None = None,
    code: str | None = None,
) -> bytes:
    """The error JSON every rollflow listener answers (``rollflow.errors.error_body``), encoded."""
    return msgspec.json.encode(_error_body(status, message, type=type_, param=param, code=code))


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    type_: str | None = None,
    code: str | None = None,
) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, param, type_, code), content_type="application/json"
    )


class ApiError(Exception):
    """A request the server refuses; the handler's middleware turns it into the error JSON with ``status``
    (and ``type_`` and ``code``, else the status's)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.type, self.code)

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.type, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


def context_length_exceeded(max_model_len: int, prompt_len: int, param: str) -> ApiError:
    """vLLM's 400 for a prompt that leaves no room for output, with ``code`` ``context_length_exceeded``."""
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
        f"{prompt_len} tokens, which leaves no room for output. Please reduce the length of the prompt.",
        param,
        code=CONTEXT_LENGTH_EXCEEDED,
    )


def engine_dead(error: BaseException) -> ApiError:
    """503 with ``type`` ``ENGINE_DEAD_TYPE``: the engine's loop died (or was shut down); restart the server."""
    return ApiError(
        503,
        f"the engine is dead: {error}; restart this server (its requests fail until then)",
        type_=ENGINE_DEAD_TYPE,
        code=ENGINE_DEAD,
    )


def engine_error(error: InferenceError) -> ApiError:
    """An ``EngineError`` of one request, answered with its own status and ``code`` (400 when the request, or
    what the weights made of it, cannot be served, ``context_length_exceeded`` among them; 500 for
    ``EngineGenerateError``, a failure inside the engine, which still fails only that request)."""
    return ApiError(error.http_status, str(error), error.param, code=error.code)


T = TypeVar("T")

NESTED_TOO_DEEPLY = "the request body's JSON is nested too deeply to decode; flatten it"

_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, type_: type[T], *, empty_ok: bool = False) -> T:
    """Decode a JSON request body into ``type_``.

    Raises:
        ApiError: 400 for an empty body (unless ``empty_ok``: then the type's defaults), malformed JSON, or a
            value of the wrong type (``param`` names the field).
    """
    if not body.strip():
        if empty_ok:
            return msgspec.convert({}, type_)
        raise bad_request(f"the request body is empty; expected a JSON object for {type_.__name__}")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as error:
        match = _PATH.search(str(error))
        raise bad_request(f"invalid request body: {error}", match.group(1) if match else None) from None
    except msgspec.DecodeError as error:
        raise bad_request(f"malformed JSON in the request body: {error}") from None
    except RecursionError:  # msgspec's depth limit, reached in an untyped (Any) field
        raise bad_request(NESTED_TOO_DEEPLY) from None


# ------------------------------------------------------------------ data plane bodies


class VllmSamplingParams(msgspec.Struct, kw_only=True):
    """vLLM ``SamplingParams`` as JSON (``/inference/v1/generate``); vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: no top-k filtering.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: what the context has left after the prompt (vLLM's server default for this endpoint).
    max_tokens: int | None = None
    min_tokens: int = 0
    # A top-k count, not a bool: 0 returns the sampled token's logprob only.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Token id -> bias; not supported by the torch engine (a 400 naming it rather than silently ignored).
    logit_bias: dict[str, float] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Overwritten by the server in vLLM; accepted and ignored.
    output_kind: int | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    """``POST /inference/v1/generate`` (tokens mode)."""

    token_ids: list[int]
    sampling_params: VllmSamplingParams = msgspec.field(default_factory=VllmSamplingParams)
    model: str | None = None
    # Lets the caller abort this request by id (``/inference/v1/abort_requests``); generated when absent.
    request_id: str | None = None
    stream: bool = False
    return_token_ids: bool | None = None
    output_mode: str = "tokens"
    cache_salt: str | None = None
    priority: int = 0
    session_id: str | None = None


class OpenAISamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields the OpenAI-style completions and chat bodies share (vLLM's names and defaults)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    # Token id -> bias; not supported by the torch engine (a 400 naming it rather than silently ignored).
    logit_bias: dict[str, float] | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options`` (OpenAI's, plus vLLM's ``continuous_usage_stats``); only valid with ``stream``."""

    include_usage: bool | None = False
    # vLLM: usage in every chunk, not only in the final one.
    continuous_usage_stats: bool | None = False


class CompletionBody(OpenAISamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is checked by hand: msgspec cannot decode a union of list types."""

    prompt: Any
    model: str | None = None
    max_tokens: int | None = 16
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    add_special_tokens: bool = True
    echo: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    session_id: str | None = None


class ChatBody(OpenAISamplingFields, kw_only=True):
    """``POST /v1/chat/completions`` (no tools parsing beyond the renderer's)."""

    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    request_id: str | None = None
    session_id: str | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (chat, rendered)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


# ------------------------------------------------------------------ control plane bodies


class AbortBody(msgspec.Struct, kw_only=True):
    """``POST /abort_requests``: no ids (or an empty list) aborts every request."""

    request_ids: list[str] | None = None


class InferenceAbortBody(msgspec.Struct, kw_only=True):
    """``POST /inference/v1/abort_requests``: ids are required."""

    request_ids: list[str]


class ResetPrefixCacheBody(msgspec.Struct, kw_only=True):
    """SkyRL sends ``/reset_prefix_cache`` a JSON body; vLLM 0.33 reads the query. Both are accepted."""

    reset_running_requests: bool = False
    reset_external: bool = False


class InitWeightTransferBody(msgspec.Struct, kw_only=True):
    """``POST /init_weight_transfer_engine``: ``init_info`` goes to the receiver as is."""

    init_info: dict[str, Any]


class StartWeightUpdateBody(msgspec.Struct, kw_only=True):
    """``POST /start_weight_update``: no body in vLLM 0.33; older layouts sent these flags (ignored)."""

    is_checkpoint_format: bool | None = None
    include_draft: bool | None = None


class UpdateWeightsBody(msgspec.Struct, kw_only=True):
    """``POST /update_weights``: one ``update_info``, or a list indexed by global worker rank."""

    update_info: dict[str, Any] | list[dict[str, Any]]


class WeightCheckerBody(msgspec.Struct, kw_only=True):
    """``POST /weight_checker`` (vLLM's): ``action = "checksum"`` asks for SHA-256 digests of held tensors."""

    action: Literal["checksum"]


class FinishWeightUpdateBody(msgspec.Struct, kw_only=True):
    """``POST /finish_weight_update``: ``weight_version`` labels the new weights (an integer policy version)."""

    weight_version: str | int | None = None


# ------------------------------------------------------------------ answers and query flags


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


def query_bool(request: web.Request, name: str, default: bool) -> bool:
    """A boolean query parameter as FastAPI parses it (true/false, 1/0, yes/no, on/off)."""
    value = request.query.get(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise bad_request(f"query parameter {name}={value!r} is not a boolean; use true or false", name)
