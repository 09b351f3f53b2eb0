"""Shared fixtures of the TITO tests: the tiny model's tokenizer and renderer, one real engine per test
session, and a scripted client for tests that need chosen completions (tool calls, delays, failures)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest

MODEL = "rollflow:tiny"


@dataclass
class TinyChat:
    model_dir: Any
    tokenizer: Any
    renderer: Any

    def renderer_with(self, **model_config: Any) -> Any:
        from rollflow.config import ModelConfig
        from rollflow.models.loading import create_chat_renderer

        return create_chat_renderer(self.tokenizer, ModelConfig(**model_config))


@pytest.fixture(scope="session")
def tiny_chat(tiny_model_dir) -> TinyChat:
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    return TinyChat(tiny_model_dir, tokenizer, create_chat_renderer(tokenizer, ModelConfig()))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """One engine for the whole test session (engines serve any event loop)."""
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm

    engine = TorchEngine(load_causal_lm(tiny_model_dir), max_batch_size=16, max_model_len=512)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture
def engine_client(tiny_engine):
    from rollflow.inference.client import LocalInferenceClient

    return LocalInferenceClient([tiny_engine])  # not closed: the engine outlives the test


class ScriptedClient:
    """An ``InferenceClient`` whose completions are chosen texts, tokenized and closed with the stop token.

    Logprobs are unique per call (``-(call + 1) - position / 1000``) so tests can tell calls apart.
    """

    def __init__(
        self,
        tokenizer: Any,
        reply: Callable[[int, GenerateRequest], str] | None = None,
        *,
        delay_s: float = 0.0,
        stop_token_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.reply = reply or (lambda call, request: f"reply {call}")
        self.delay_s = delay_s
        self.stop_token_id = (
            stop_token_id if stop_token_id is not None else tokenizer.convert_tokens_to_ids("<|im_end|>")
        )
        self.requests: list[GenerateRequest] = []
        self.outputs: list[GenerateOutput] = []
        self.cancelled = 0
        self._calls = itertools.count()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        call = next(self._calls)
        self.requests.append(request)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = [
            *self.tokenizer.encode(self.reply(call, request), add_special_tokens=False),
            self.stop_token_id,
        ]
        finish = FinishReason.STOP
        if len(ids) > request.sampling.max_tokens:
            ids, finish = ids[: request.sampling.max_tokens], FinishReason.LENGTH
        output = GenerateOutput(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[-(call + 1) - i / 1000 for i in range(len(ids))],
            finish_reason=finish,
            policy_versions=[call] * len(ids),
            prompt_len=len(request.prompt_token_ids),
        )
        self.outputs.append(output)
        return output

    async def pause(self, mode: str = "abort") -> None: ...
    async def resume(self) -> None: ...
    async def is_paused(self) -> bool:
        return False

    async def update_named_weights(self, named_tensors: Any, policy_version: int) -> None: ...
    async def get_world_size(self) -> int:
        return 1

    async def close(self) -> None: ...


def make_session(client: Any, chat: TinyChat, renderer: Any = None, session_id: str = "s") -> Any:
    """A ``Session`` without the HTTP server, for tests of rendering, tracing and composing."""
    from rollflow.tito.renderer import TITORenderer
    from rollflow.tito.session import Session, TurnSettings

    adapter = TITORenderer(renderer or chat.renderer, chat.tokenizer)
    return Session(session_id, "token", "http://unused", client, adapter, TurnSettings(MODEL))


async def ask(session: Any, messages: list[dict], **fields: Any) -> Any:
    """Send one request straight to a session; returns the recorded ``Turn`` (the first, for ``n > 1``)."""
    import msgspec

    from rollflow.tito.wire import ChatCompletionRequest, validate_request

    request = msgspec.convert({"model": MODEL, "messages": messages, **fields}, ChatCompletionRequest)
    validate_request(request)
    return (await session.complete(request))[0]


def as_history_message(turn: Any) -> dict:
    """The assistant message of a turn as an OpenAI client sends it back."""
    from rollflow.tito.session import arguments_text

    message = {"role": "assistant", "content": turn.message["content"]}
    if "tool_calls" in turn.message:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": arguments_text(call["function"]["arguments"]),
                },
            }
            for call in turn.message["tool_calls"]
        ]
    return message
