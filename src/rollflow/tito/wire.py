"""OpenAI Chat Completions wire types (the subset the TITO proxy serves) and request validation.

Requests decode straight into msgspec Structs. A field the proxy does not know is ignored, as vLLM does, and
reported to the caller (``DecodedRequest.unknown_fields``; the proxy counts them), or with ``strict`` a 400
that names it; a known field with a wrong type or a value the proxy cannot honour is always a 400 naming it.
Unknown fields cost nothing on the common path: the strict decode runs first, and only a body it refuses
for an unknown field is decoded again without them. Responses and stream chunks are built as Structs and
encoded once. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from rollflow.errors import RequestError
from rollflow.messages import sampling_error

# Most stop strings a request may give, and the longest one (in characters).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
# chat_template_kwargs the proxy applies (the others are ignored and reported, or refused when strict).
TEMPLATE_KWARGS = ("enable_thinking",)

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- request


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    # Prompt-caching hints some SDKs attach to parts; they do not change the tokens.
    cache_control: dict[str, Any] | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"
    # Present in some SDKs' streamed-then-accumulated tool calls.
    index: int | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Reasoning the proxy returned; clients may send it back (either spelling).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # Fields the openai SDK serializes when a response message is appended to the history; must be empty.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: str = "function"


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A Chat Completions request. Unsupported values are rejected by ``validate_request``."""

    model: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    # vLLM: keep the stop string that ended the reply in its text.
    include_stop_str_in_output: bool | None = None
    seed: int | None = None
    # n > 1: that many replies to one prompt, each its own branch of the session's tree.
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's sampling extras: honoured, or the run's values when the proxy enforces sampling.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # vLLM: template switches for this request (``enable_thinking``).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: the prompt's and the reply's token ids in the response, to check them against what is trained.
    return_token_ids: bool | None = None
    # Accepted and ignored: they do not affect sampling.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    # Change the policy's distribution: the run's (none) when sampling is enforced, else refused unless neutral.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None


_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


@dataclass(slots=True)
class DecodedRequest:
    """A validated request and what of it the proxy does not apply."""

    request: ChatCompletionRequest
    # Paths of fields the proxy does not know (``frobnicate``, ``messages[0].colour``): ignored.
    unknown_fields: list[str] = field(default_factory=list)
    # Known fields whose value the proxy cannot enforce and leaves aside (``tool_choice``).
    ignored_values: list[str] = field(default_factory=list)
    # Set by the proxy's admission: the side-call kind (``rollflow.tito.side_calls``), None when trainable.
    side_call: str | None = None


def decode_request(body: bytes, *, strict: bool = False, max_n: int = 16) -> DecodedRequest:
    """Decode and validate a request body.

    ``strict``: unknown fields and values the proxy cannot enforce are refused instead of ignored.
    ``max_n``: the most replies one request may ask for (``n``).

    Raises:
        RequestError: malformed JSON, a wrong type or value (400, naming the field), or with ``strict`` an
            unknown field or a value that cannot be enforced.
    """
    request, unknown = decode_body(body, ChatCompletionRequest, strict=strict)
    decoded = DecodedRequest(request, unknown)
    validate_request(request, strict=strict, max_n=max_n, ignored=decoded.ignored_values)
    return decoded


def decode_body(body: bytes, type_: type[T], *, strict: bool = False) -> tuple[T, list[str]]:
    """``body`` decoded as ``type_`` (a Struct with ``forbid_unknown_fields``) and the paths of the fields it
    does not declare, which are dropped; with ``strict`` such a field is refused instead. Every wire format
    the proxy serves decodes through here, so all of them tolerate (and count) the same way.

    Raises:
        RequestError: malformed JSON, a wrong type (400, naming the field), or with ``strict`` an unknown field.
    """
    unknown: list[str] = []
    try:
        try:
            value = msgspec.json.decode(body, type=type_)
        except msgspec.ValidationError as error:
            if strict or not _UNKNOWN.search(str(error)):
                raise
            # Unknown fields somewhere: decode again without them (only such bodies pay for this).
            data = msgspec.json.decode(body)
            _drop_unknown(data, _type_info(type_), "", unknown)
            value = msgspec.convert(data, type_)
    except msgspec.ValidationError as error:
        text = str(error)
        match = _PATH.search(text)
        path = match.group("path") if match else None
        unknown_match = _UNKNOWN.search(text)
        if unknown_match:
            name = unknown_match.group("name")
            path = f"{path}.{name}" if path else name
            raise RequestError(
                f"unsupported field {path!r}: the rollflow TITO proxy does not support it (agent.strict_requests "
                "is on; turn it off to ignore unknown fields)",
                param=path,
            ) from None
        raise RequestError(f"invalid request: {text}", param=path or None) from None
    except msgspec.DecodeError as error:
        raise RequestError(f"request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # msgspec's depth limit, reached in an untyped field
        raise RequestError(
            "request body JSON is nested too deeply to decode; flatten it", code="invalid_json"
        ) from None
    return value, unknown


@functools.cache
def _type_info(type_: type) -> Any:
    return msgspec.inspect.type_info(type_)


def _drop_unknown(value: Any, info: Any, path: str, unknown: list[str]) -> None:
    """Remove, in place, the keys of ``value`` (decoded JSON) that the type ``info`` does not declare,
    appending their paths to ``unknown``. Values of the wrong shape are left for the typed decode to refuse."""
    inspect = msgspec.inspect
    if isinstance(info, inspect.UnionType):
        for option in info.types:
            if isinstance(value, dict) and isinstance(option, inspect.StructType | inspect.DictType):
                return _drop_unknown(value, option, path, unknown)
            if isinstance(value, list) and isinstance(option, inspect.ListType):
                return _drop_unknown(value, option, path, unknown)
        return None
    if isinstance(info, inspect.ListType) and isinstance(value, list):
        for index, item in enumerate(value):
            _drop_unknown(item, info.item_type, f"{path}[{index}]", unknown)
    elif isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in info.fields}
        for key in list(value):
            known = fields.get(key)
            where = f"{path}.{key}" if path else key
            if known is None:
                del value[key]
                unknown.append(where)
            else:
                _drop_unknown(value[key], known.type, where, unknown)
    return None


def _reject(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code="unsupported_value")


def validate_request(
    request: ChatCompletionRequest, *, strict: bool = False, max_n: int = 16, ignored: list[str] | None = None
) -> None:
    """Reject what the proxy cannot honour exactly (``RequestError`` naming the field). Values it can leave
    aside (``tool_choice`` other than ``auto``, unknown ``chat_template_kwargs``) are appended to ``ignored``,
    or refused when ``strict``."""
    ignored = [] if ignored is None else ignored

    def leave_aside(param: str, why: str) -> None:
        if strict:
            raise _reject(param, f"{why} (agent.strict_requests is on; turn it off to ignore it)")
        ignored.append(param)

    if not request.messages:
        raise _reject("messages", "must hold at least one message")
    if request.n is not None and not 1 <= request.n <= max_n:
        raise _reject(
            "n", f"must be between 1 and {max_n} (the replies one request may ask for), got {request.n}"
        )
    if (request.n or 1) > 1 and request.stream:
        raise _reject("n", "n > 1 is not supported with stream: true; send n requests, or do not stream")
    if request.stream_options is not None and not request.stream:
        raise _reject("stream_options", "only valid with stream: true")
    if request.top_logprobs:
        raise _reject("top_logprobs", "top logprobs are not supported; use logprobs=true")
    _validate_stop(request.stop)
    if request.tool_choice not in (None, "auto"):
        if request.tool_choice not in ("none", "required") and not isinstance(request.tool_choice, dict):
            raise _reject(
                "tool_choice",
                f"must be 'auto', 'none', 'required' or a function, got {request.tool_choice!r}",
            )
        leave_aside("tool_choice", f"{request.tool_choice!r} cannot be enforced; the model decides ('auto')")
    if request.parallel_tool_calls is False:
        leave_aside("parallel_tool_calls", "false cannot be enforced")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request, name)
        if value is not None and not (math.isfinite(value) and -2 <= value <= 2):
            raise _reject(name, f"must be in [-2, 2], got {value}")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise _reject("response_format", "structured outputs are not supported")
    if request.reasoning_effort is not None:
        raise _reject(
            "reasoning_effort",
            "not supported; thinking is set by model.enable_thinking or chat_template_kwargs.enable_thinking",
        )
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise _reject("temperature", f"must be in [0, 2], got {request.temperature}")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise _reject("top_p", f"must be in (0, 1], got {request.top_p}")
    problem = sampling_error(
        max_tokens=1,
        temperature=1.0,
        top_p=1.0,
        top_k=-1 if request.top_k is None else request.top_k,
        seed=request.seed,
    )
    if problem is not None:
        raise _reject(*problem)
    if request.min_p is not None and not (math.isfinite(request.min_p) and 0 <= request.min_p <= 1):
        raise _reject("min_p", f"must be in [0, 1], got {request.min_p}")
    if request.repetition_penalty is not None and not (
        math.isfinite(request.repetition_penalty) and 0 < request.repetition_penalty <= 100
    ):
        raise _reject(
            "repetition_penalty", f"must be in (0, 100] (1 disables it), got {request.repetition_penalty}"
        )
    for key, value in (request.chat_template_kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key not in TEMPLATE_KWARGS:
            leave_aside(
                param, f"{key!r} is not a template switch the proxy applies ({', '.join(TEMPLATE_KWARGS)})"
            )
        elif not isinstance(value, bool):
            raise _reject(param, f"must be true or false, got {value!r}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise _reject(name, f"must be >= 1, got {value}")
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function":
            raise _reject(f"tools[{i}].type", f"only 'function' tools are supported, got {tool.type!r}")
    for i, message in enumerate(request.messages):
        _validate_message(i, message)


def stop_strings(request: ChatCompletionRequest) -> list[str]:
    """The request's stop strings as a list (``stop`` may be one string)."""
    stop = request.stop
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _validate_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise _reject("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for index, text in enumerate(stops):
        if not text or len(text) > MAX_STOP_CHARS:
            param = "stop" if isinstance(stop, str) else f"stop[{index}]"
            raise _reject(param, f"a stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(text)}")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _validate_message(i: int, message: ChatMessage) -> None:
    where = f"messages[{i}]"
    if message.role not in _ROLES:
        raise _reject(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {message.role!r}")
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if part.type != "text" or part.text is None:
                raise _reject(
                    f"{where}.content[{j}].type", f"only text parts are supported, got {part.type!r}"
                )
    for name in ("refusal", "audio", "function_call"):
        if getattr(message, name) is not None:
            raise _reject(f"{where}.{name}", "not supported; leave it null")
    if message.annotations:
        raise _reject(f"{where}.annotations", "not supported; leave it empty")
    if message.tool_calls and message.role != "assistant":
        raise _reject(f"{where}.tool_calls", "only assistant messages carry tool calls")
    if message.role == "tool" and message.content is None:
        raise _reject(f"{where}.content", "a tool message needs content")
    if message.role in ("system", "developer", "user") and message.content is None:
        raise _reject(f"{where}.content", f"a {message.role} message needs content")
    for j, call in enumerate(message.tool_calls or []):
        if call.type != "function":
            raise _reject(f"{where}.tool_calls[{j}].type", f"must be 'function', got {call.type!r}")


# --------------------------------------------------------------------------------------------- response


class ResponseFunction(msgspec.Struct):
    name: str
    arguments: str


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunction
    type: str = "function"


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = []


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class Choice(msgspec.Struct):
    message: ResponseMessage
    finish_reason: str
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    # vLLM: the stop string that ended the reply (null: the model's own stop token, or the length limit).
    stop_reason: str | None = None
    # vLLM, with return_token_ids: the reply's token ids.
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM, with return_token_ids: the prompt's token ids (at the top level, as vLLM's chat endpoint has them).
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    delta: Delta
    index: int = 0
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | msgspec.UnsetType = msgspec.UNSET
    # With return_token_ids: the reply's token ids, all in the finish chunk.
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    # With return_token_ids: the prompt's token ids, in the finish chunk.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "rollflow"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
