"""What the endpoints of every API share: a decoded request and how its API answers (``TurnRequest``), its
checks and turn (``answer_turn``, for the front and aiohttp alike; ``serve_request`` and ``serve_turn``, the
aiohttp route, streamed or not), and turning recorded messages back into request messages."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from aiohttp import web

from rollflow.errors import RequestError, RollflowError, TraceSealedError, error_body
from rollflow.tito.apis.streaming import TurnWriter, stream_turn
from rollflow.tito.session import Session, arguments_text
from rollflow.tito.trace import Turn
from rollflow.tito.wire import (
    ChatCompletionRequest,
    ChatMessage,
    DecodedRequest,
    FunctionCall,
    ToolCall,
    validate_request,
)

if TYPE_CHECKING:
    from rollflow.tito.proxy import TITOProxy

log = structlog.get_logger("rollflow.tito.proxy")  # the proxy's log: where its request failures always went
_ENCODER = msgspec.json.Encoder()


def error_answer(error: Exception) -> tuple[int, Any]:
    """(status, JSON body) for an exception a request handler raised: the same for aiohttp and the front."""
    if isinstance(error, RequestError):
        return error.status, error.body()
    if isinstance(error, TraceSealedError):
        return 409, error_body(409, str(error), code="session_closed")
    if isinstance(error, RollflowError):
        log.exception("tito proxy: request failed")
        return 500, error_body(500, f"{type(error).__name__}: {error}")
    log.exception("tito proxy: unexpected error")  # a bug: say so, keep serving
    return 500, error_body(500, f"internal error: {type(error).__name__}: {error}")


def refuse(param: str, message: str, *, status: int = 400, code: str = "unsupported_value") -> RequestError:
    """A 4xx naming ``param`` (the API's own field path)."""
    return RequestError(f"{param}: {message}", status=status, param=param, code=code)


def leave_aside(ignored: list[str], param: str, why: str, *, strict: bool) -> None:
    """Count a value the proxy cannot enforce in ``ignored``, or refuse it when ``strict``."""
    if strict:
        raise refuse(param, f"{why} (agent.strict_requests is on; turn it off to ignore it)")
    ignored.append(param)


def validate_chat(
    chat: ChatCompletionRequest, *, strict: bool, ignored: list[str], renames: dict[str, str]
) -> None:
    """``validate_request`` on a translated request, its errors and ignored values named by the API's own
    fields (``renames``: the Chat Completions name → the API's)."""
    found: list[str] = []
    try:
        validate_request(chat, strict=strict, ignored=found)
    except RequestError as error:
        param = error.param
        head = re.match(r"[^.\[]*", param).group() if param is not None else ""
        if param is not None and head in renames:
            renamed = renames[head] + param[len(head) :]
            error = RequestError(
                error.message.replace(param, renamed, 1),
                status=error.status,
                param=renamed,
                code=error.code,
            )
        raise error from None
    ignored += [renames.get(name, name) for name in found]


def history_message(message: dict[str, Any]) -> ChatMessage:
    """A recorded (normalized) message as the request message that normalizes back to it."""
    calls = [
        ToolCall(
            FunctionCall(call["function"]["name"], arguments_text(call["function"]["arguments"])),
            id=call["id"],
        )
        for call in message.get("tool_calls", ())
    ]
    return ChatMessage(
        role=message["role"],
        content=message["content"],
        name=message.get("name"),
        tool_calls=calls or None,
        tool_call_id=message.get("tool_call_id"),
        reasoning_content=message.get("reasoning_content"),
    )


def tool_input(arguments: Any) -> dict[str, Any]:
    """Parsed tool-call arguments as an object (APIs whose tool calls carry objects, not JSON text); arguments
    that are not a JSON object come as ``{"arguments": text}``."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, TypeError, RecursionError):
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def turn_hex(response_id: str) -> str:
    """The unique part of a turn's id (``chatcmpl-<hex>``), from which each API makes its own ids."""
    return response_id.rpartition("-")[2]


@dataclass(slots=True)
class TurnRequest:
    """A request of one API, decoded and translated, with how that API answers it: what the aiohttp route
    and the listener's front (``TITOProxy.fast_request``) share, so that both serve it alike."""

    # The API's name for side-call rules: "chat", "responses" or "messages".
    api: str
    decoded: DecodedRequest
    # The JSON body (a value msgspec encodes) of the non-streamed answer of the recorded turns.
    reply: Callable[[list[Turn]], Any]
    # The writer of the streamed answer (``stream_turn``).
    writer_for: Callable[[str, int], TurnWriter]
    # (status, JSON body) of an error in the API's own shape (``error_answer`` for OpenAI's).
    error_answer: Callable[[Exception], tuple[int, Any]] = error_answer

    @property
    def stream(self) -> bool:
        return bool(self.decoded.request.stream)


async def answer_turn(
    proxy: TITOProxy,
    session: Session,
    turn_request: TurnRequest,
    body: bytes,
    idempotency_key: str | None,
    retry_count: str | None,
    headers: Mapping[str, str] | Callable[[], Mapping[str, str]],
) -> Any:
    """Admit a non-streamed request (``TITOProxy.admit``: prompt size, model, idempotency, side calls;
    counting what it ignores), run its turn and return the answer's JSON body.

    Raises:
        RequestError: the request is refused.
        TraceSealedError: the session is closed.
    """
    decoded = turn_request.decoded
    key, is_retry = proxy.admit(
        session, decoded, body, idempotency_key, retry_count, api=turn_request.api, headers=headers
    )
    turns = await session.complete(
        decoded.request, request_key=key, is_retry=is_retry, side_call=decoded.side_call
    )
    return turn_request.reply(turns)


async def serve_request(
    prepare: Callable[[TITOProxy, Session, bytes], TurnRequest], proxy: TITOProxy, request: web.Request
) -> web.StreamResponse:
    """The aiohttp route of a turn endpoint (``/chat/completions``, ``/responses``, ``/messages``): its
    session and body, ``prepare`` (the API's ``prepare_*``, the one the front serves too), ``serve_turn``.

    Raises:
        RequestError: an unknown or closed session, a body over the limit, a request that is refused.
        TraceSealedError: the session is closed.
    """
    session = proxy.session_for(request)
    body = await proxy.read_body(request)
    return await serve_turn(proxy, request, session, body, prepare(proxy, session, body))


async def serve_turn(
    proxy: TITOProxy, request: web.Request, session: Session, body: bytes, turn_request: TurnRequest
) -> web.StreamResponse:
    """The aiohttp answer of a request: streamed by its writer, else ``answer_turn``'s body as JSON.

    Raises:
        RequestError: the request is refused (before its first token when streamed).
        TraceSealedError: the session is closed.
    """
    headers = request.headers
    idempotency_key, retry_count = headers.get("Idempotency-Key"), headers.get("x-stainless-retry-count")
    if not turn_request.stream:
        data = await answer_turn(proxy, session, turn_request, body, idempotency_key, retry_count, headers)
        return web.Response(body=_ENCODER.encode(data), content_type="application/json")
    decoded = turn_request.decoded
    key, is_retry = proxy.admit(
        session, decoded, body, idempotency_key, retry_count, api=turn_request.api, headers=headers
    )
    return await stream_turn(
        request,
        session,
        decoded.request,
        key,
        is_retry,
        turn_request.writer_for,
        side_call=decoded.side_call,
    )


def thinking_switch_unused(strict: bool) -> str:
    """The ignored value's name for ``chat_template_kwargs.enable_thinking`` on a renderer without that switch
    (its template ignores the key, as vLLM's does: many agent configs send it to every model).

    Raises:
        RequestError: ``strict`` (``agent.strict_requests``) refuses it instead.
    """
    param = "chat_template_kwargs.enable_thinking"
    if strict:
        raise RequestError(
            f"{param}: this model's renderer has no thinking switch (agent.strict_requests is on; turn it off to "
            "ignore it, or leave it unset)",
            param=param,
            code="unsupported_value",
        )
    return param


def request_key(idempotency_key: str | None, retry_count: str | None, body: bytes) -> tuple[str | None, bool]:
    """(key, is_retry): an ``Idempotency-Key`` names a request across retries; otherwise the openai SDK's
    ``x-stainless-retry-count`` marks retries, recognized by an identical body. Unmarked identical bodies
    are new requests (an agent may legitimately repeat one)."""
    if idempotency_key:
        return "key:" + idempotency_key, True
    if retry_count is None:
        return None, False
    digest = hashlib.blake2b(body, digest_size=16).hexdigest()
    return "body:" + digest, retry_count.strip() not in ("", "0")
