"""Large chat requests render off the event loop whatever part of them is large: assistant turns, tool calls'
arguments and tool definitions count toward the offload size (``prompt_limits.rendered_chars``) as the user
text always did. The renderer is wrapped to record which thread rendered."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from rollflow.inference.prompt_limits import OFFLOAD_CHARS, message_text_chars, rendered_chars
from tests.helpers.posts import post_json
from tests.helpers.tito import MODEL, ScriptedClient

LONG = "hello world " * (OFFLOAD_CHARS // 12 + 10)  # over OFFLOAD_CHARS, far under the prompt cap


class _Recording:
    """Delegates to ``inner``; records the thread of each call of ``methods``."""

    def __init__(self, inner: Any, methods: tuple[str, ...]):
        self._inner = inner
        self._methods = methods
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self._methods:
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return value(*args, **kwargs)

        return recorded


def _tool(description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }


def _call(arguments: str) -> dict:
    return {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


# Each large in one place only; the user's text is short, so the refusal bound's count stays small.
CASES = {
    "assistant content": (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": LONG},
            {"role": "user", "content": "and?"},
        ],
        None,
    ),
    "tool call arguments": (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [_call(json.dumps({"q": LONG}))]},
            {"role": "tool", "tool_call_id": "call-1", "content": "ok"},
        ],
        [_tool("look it up")],
    ),
    "tool definitions": ([{"role": "user", "content": "hi"}], [_tool(LONG)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rendered_chars_counts_every_rendered_part(case):
    messages, tools = CASES[case]
    assert message_text_chars(messages) < 10  # the refusal bound's lower count leaves these parts out
    assert rendered_chars(messages, tools) > OFFLOAD_CHARS
    # Arguments sent parsed (a dict, as some clients do) count too.
    if case == "tool call arguments":
        parsed = [{**messages[1], "tool_calls": [_call({"q": LONG})]}]  # type: ignore[dict-item]
        assert rendered_chars(parsed) > OFFLOAD_CHARS


def test_rendered_chars_of_a_small_request_is_small():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert rendered_chars(messages, [_tool("look it up")]) < 500


@pytest.fixture
async def server(tiny_chat, uncached_engine):
    from rollflow.inference.engine.server import EngineServer

    renderer = _Recording(tiny_chat.renderer, ("render_ids",))
    server = EngineServer(
        uncached_engine,
        tiny_chat.tokenizer,
        served_model_name="tiny",
        renderer=renderer,
        max_body_bytes=2**24,
    )
    url = await server.start()
    try:
        yield url, renderer
    finally:
        # Not server.close(): the module's engine outlives the test.
        await server._runner.cleanup()


@pytest.mark.parametrize("case", list(CASES))
async def test_server_renders_large_chat_parts_off_the_loop(server, case):
    url, renderer = server
    main = threading.current_thread().name
    status, reply = await post_json(url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, reply
    assert renderer.threads[-1] == main  # small: inline
    messages, tools = CASES[case]
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    status, reply = await post_json(url + "/tokenize", body)
    assert status == 200, reply
    assert len(renderer.threads) == 2 and renderer.threads[-1] != main  # large: in a worker thread


async def test_tito_proxy_renders_a_long_assistant_turn_off_the_loop(tiny_chat):
    from rollflow.tito import TITOProxy
    from rollflow.tito.renderer import TITORenderer

    adapter = TITORenderer(tiny_chat.renderer, tiny_chat.tokenizer)
    adapter.renderer = _Recording(tiny_chat.renderer, ("render",))
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        client, adapter, tiny_chat.tokenizer, model_name=MODEL, max_model_len=2048, max_body_bytes=2**24
    ) as proxy:
        session = await proxy.open_session()
        messages, _ = CASES["assistant content"]
        status, reply = await post_json(
            f"{session.base_url}/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}
        )
        assert adapter.renderer.threads, reply
        assert all(thread != threading.current_thread().name for thread in adapter.renderer.threads)
        assert status == 200, reply
