"""OpenAI Chat Completions wire types (the subset the TITO proxy serves) and request validation.

Requests decode straight into msgspec Structs with unknown fields forbidden, so a typo or an unsupported
OpenAI feature becomes a 400 that names the field instead of being silently ignored. Responses and stream
chunks are built as Structs and encoded once. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from rollflow.errors import RollflowError


class RequestError(RollflowError):
    """A request the proxy refuses; carries the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted and ignored: they do not affect sampling.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    # Rejected unless neutral: rollflow samples exactly what the policy gives.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None


_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a request body.

    Raises:
        RequestError: malformed JSON, a wrong type, an unknown or unsupported field (400, naming the field).
    """
    try:
        request = msgspec.json.decode(body, type=ChatCompletionRequest)
    except msgspec.ValidationError as error:
        text = str(error)
        match = _PATH.search(text)
        path = match.group("path") if match else None
        unknown = _UNKNOWN.search(text)
        if unknown:
            path = f"{path}.{unknown.group('name')}" if path else unknown.group("name")
            raise RequestError(
                f"unsupported field {path!r}: the rollflow TITO proxy does not support it", param=path
            ) from None
        raise RequestError(f"invalid request: {text}", param=path or None) from None
    except msgspec.DecodeError as error:
        raise RequestError(f"request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # msgspec's depth limit, reached in an untyped field
        raise RequestError(
            "request body JSON is nested too deeply to decode; flatten it", code="invalid_json"
        ) from None
    validate_request(request)
    return request


def _reject(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code="unsupported_value")


def validate_request(request: ChatCompletionRequest) -> None:
    """Reject what the proxy cannot honour exactly. Raises ``RequestError`` naming the field."""
    if not request.messages:
        raise _reject("messages", "must hold at least one message")
    if request.n not in (None, 1):
        raise _reject("n", f"only n=1 is supported, got {request.n}; send one request per sample")
    if request.stream_options is not None and not request.stream:
        raise _reject("stream_options", "only valid with stream: true")
    if request.top_logprobs:
        raise _reject("top_logprobs", "top logprobs are not supported; use logprobs=true")
    if request.stop:
        raise _reject("stop", "stop strings are not supported; the model's own stop tokens end a turn")
    if request.tool_choice not in (None, "auto"):
        raise _reject("tool_choice", f"only 'auto' is supported, got {request.tool_choice!r}")
    if request.parallel_tool_calls is False:
        raise _reject("parallel_tool_calls", "false cannot be enforced; leave it unset")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise _reject(name, "penalties would change the policy's distribution; leave it unset or 0")
    if request.logit_bias:
        raise _reject("logit_bias", "would change the policy's distribution; leave it unset")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise _reject("response_format", "structured outputs are not supported")
    if request.reasoning_effort is not None:
        raise _reject("reasoning_effort", "not supported; thinking is set by model.enable_thinking")
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise _reject("temperature", f"must be in [0, 2], got {request.temperature}")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise _reject("top_p", f"must be in (0, 1], got {request.top_p}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise _reject(name, f"must be >= 1, got {value}")
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function":
            raise _reject(f"tools[{i}].type", f"only 'function' tools are supported, got {tool.type!r}")
    for i, message in enumerate(request.messages):
        _validate_message(i, message)


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


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "rollflow"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
