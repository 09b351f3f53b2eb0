"""The tiny model's chat pieces and session helpers, shared by the TITO tests and benchmarks.

Benchmarks never import ``tests/``; what both need lives here. Nothing here imports torch or transformers at
module scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "rollflow:tiny"


@dataclass
class TinyChat:
    """The tiny model's directory, tokenizer and chat renderer."""

    model_dir: Any
    tokenizer: Any
    renderer: Any

    def renderer_with(self, **model_config: Any) -> Any:
        """Another renderer of the same tokenizer, for ``ModelConfig(**model_config)``."""
        from rollflow.config import ModelConfig
        from rollflow.models.loading import create_chat_renderer

        return create_chat_renderer(self.tokenizer, ModelConfig(**model_config))


def load_tiny_chat(model_dir: Any = None) -> TinyChat:
    """The tiny model (built locally on first use) with its tokenizer and default renderer."""
    from rollflow.config import ModelConfig
    from rollflow.models.loading import create_chat_renderer, load_tokenizer
    from rollflow.models.tiny import ensure_tiny_model

    model_dir = model_dir if model_dir is not None else ensure_tiny_model()
    tokenizer = load_tokenizer(model_dir)
    return TinyChat(model_dir, tokenizer, create_chat_renderer(tokenizer, ModelConfig()))


def make_session(client: Any, chat: TinyChat, renderer: Any = None, session_id: str = "s") -> Any:
    """A ``Session`` without the HTTP server, for measuring or testing rendering, tracing and composing."""
    from rollflow.tito.renderer import TITORenderer
    from rollflow.tito.session import Session, TurnSettings

    adapter = TITORenderer(renderer or chat.renderer, chat.tokenizer)
    return Session(session_id, "token", "http://unused", client, adapter, TurnSettings(MODEL))


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
