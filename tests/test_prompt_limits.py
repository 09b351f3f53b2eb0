"""Long inputs: refused by their length before tokenizing, and tokenized or rendered off the event loop.

Engine server (``rollflow serve``'s) and TITO proxy on real loopback servers with the tiny model; the
tokenizer and renderer are wrapped to record which thread did the work.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rollflow.inference.prompt_limits import OFFLOAD_CHARS, max_prompt_chars, max_token_chars
from tests.helpers.posts import post_json
from tests.helpers.tito import MODEL, ScriptedClient
from tests.helpers.waits import wait_until


class Recording:
    """Delegates to ``inner``; records the thread of each call of ``methods``."""

    def __init__(self, inner: Any, methods: tuple[str, ...]):
        self._inner = inner
        self._methods = methods
        self.threads: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self._methods:
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.append((name, threading.current_thread().name))
            return value(*args, **kwargs)

        return recorded


def test_char_cap_follows_the_longest_token(tiny_chat):
    longest = max(len(token) for token in tiny_chat.tokenizer.get_vocab())
    assert max_token_chars(tiny_chat.tokenizer) == longest
    assert max_prompt_chars(100, tiny_chat.tokenizer) == 100 * longest * 4
    # The bound holds: the text that packs the most characters into each token still needs more than
    # max_model_len tokens when it is over the cap.
    token = max(tiny_chat.tokenizer.get_vocab(), key=len)
    text = tiny_chat.tokenizer.convert_tokens_to_string([token]) * 200
    assert len(tiny_chat.tokenizer.encode(text, add_special_tokens=False)) * longest * 4 >= len(text)


@pytest.fixture
async def server(tiny_chat, uncached_engine):
    from rollflow.inference.engine.server import EngineServer

    tokenizer = Recording(tiny_chat.tokenizer, ("encode",))
    renderer = Recording(tiny_chat.renderer, ("render_ids",))
    server = EngineServer(
        uncached_engine, tokenizer, served_model_name="tiny", renderer=renderer, max_body_bytes=64 * 2**20
    )
    url = await server.start()
    try:
        yield server, url, tokenizer, renderer
    finally:
        # Not server.close(): the module's engine outlives the test.
        await server._runner.cleanup()


async def test_text_over_the_cap_is_refused_without_tokenizing(server):
    server, url, tokenizer, renderer = server
    over = "x" * (server.max_prompt_chars + 1)
    for path, body, param in (
        ("/v1/completions", {"prompt": over, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", over], "max_tokens": 1}, "prompt"),
        ("/tokenize", {"prompt": over}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": over}]}]},
            "messages",
        ),
    ):
        status, reply = await post_json(url + path, body)
        assert status == 400, (path, reply)
        assert reply["error"]["param"] == param
        assert f"{len(over)} characters" in reply["error"]["message"]
    assert tokenizer.threads == [] and renderer.threads == []


async def test_token_ids_over_max_model_len_are_refused_by_their_count(server):
    server, url, _, _ = server
    too_many = [10**9] * server.engine.max_model_len  # out of the vocabulary too: the count is checked first
    status, reply = await post_json(url + "/inference/v1/generate", {"token_ids": too_many})
    assert status == 400
    assert f"has {len(too_many)} tokens" in reply["error"]["message"]


async def test_long_text_is_tokenized_and_rendered_in_a_worker_thread(server):
    server, url, tokenizer, renderer = server
    main = threading.current_thread().name
    long_text = "hello world " * (OFFLOAD_CHARS // 12 + 10)
    assert OFFLOAD_CHARS < len(long_text) <= server.max_prompt_chars
    status, _ = await post_json(url + "/tokenize", {"prompt": "short"})
    assert status == 200
    status, reply = await post_json(url + "/tokenize", {"prompt": long_text})
    assert status == 200 and reply["count"] > 1000
    assert tokenizer.threads[0][1] == main  # short: inline
    assert tokenizer.threads[-1][1] != main  # long: off the event loop
    messages = [{"role": "user", "content": long_text}]
    status, reply = await post_json(url + "/tokenize", {"messages": messages})
    assert status == 200
    assert renderer.threads[-1][1] != main


async def test_tito_proxy_refuses_messages_over_the_cap_and_renders_long_ones_off_the_loop(tiny_chat):
    from rollflow.tito import TITOProxy
    from rollflow.tito.renderer import TITORenderer

    adapter = TITORenderer(tiny_chat.renderer, tiny_chat.tokenizer)
    adapter.renderer = Recording(tiny_chat.renderer, ("render",))
    client = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        client, adapter, tiny_chat.tokenizer, model_name=MODEL, max_model_len=2048, max_body_bytes=2**24
    ) as proxy:
        session = await proxy.open_session()
        url = f"{session.base_url}/chat/completions"
        over = "x" * (proxy.max_prompt_chars + 1)
        status, reply = await post_json(
            url, {"model": MODEL, "messages": [{"role": "user", "content": over}]}
        )
        assert status == 400
        assert reply["error"]["code"] == "context_length_exceeded"
        assert reply["error"]["param"] == "messages"
        assert adapter.renderer.threads == []
        assert session.trace.stats.context_exceeded == 1  # as when the engine refuses the prompt
        long_text = "hello world " * (OFFLOAD_CHARS // 12 + 10)
        status, reply = await post_json(
            url, {"model": MODEL, "messages": [{"role": "user", "content": long_text}], "max_tokens": 4}
        )
        # Under the cap: rendered, off the event loop.
        assert adapter.renderer.threads[-1][1] != threading.current_thread().name
        assert status == 200, reply


async def test_trace_survives_a_caller_leaving_during_an_offloaded_render(tiny_chat):
    """A client that disconnects while its large request renders in a worker thread: the trace's mailbox
    goes on with the next operation."""
    import asyncio
    import time

    from rollflow.tito.renderer import TITORenderer
    from rollflow.tito.trace import Trace

    class SlowRenderer(Recording):
        def render(self, *args: Any, **kwargs: Any) -> Any:
            self.threads.append(("render", threading.current_thread().name))
            time.sleep(0.3)
            return self._inner.render(*args, **kwargs)

    renderer = SlowRenderer(tiny_chat.renderer, ())
    trace = Trace(TITORenderer(renderer, tiny_chat.tokenizer), "s")
    messages = [{"role": "user", "content": "hi"}]
    leaving = asyncio.create_task(trace.prepare(messages, None, offload=True))
    await wait_until(lambda: renderer.threads, "the render is running in its thread")
    leaving.cancel()
    prepared = await asyncio.wait_for(trace.prepare(messages, None, offload=True), 60)
    assert prepared.prompt_ids


async def test_trace_operations_keep_their_order_whether_run_at_once_or_queued(tiny_chat):
    """An operation on an idle trace runs at once in its caller (no task); one that arrives while another is
    running (here an offloaded render) waits its turn, and all run in the order they were asked for."""
    import asyncio
    import time

    from rollflow.tito.renderer import TITORenderer
    from rollflow.tito.trace import Trace

    class SlowRenderer(Recording):
        def render(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            self.threads.append((messages[0]["content"], threading.current_thread().name))
            if messages[0]["content"] == "slow":
                time.sleep(0.2)
            return self._inner.render(messages, *args, **kwargs)

    renderer = SlowRenderer(tiny_chat.renderer, ())
    trace = Trace(TITORenderer(renderer, tiny_chat.tokenizer), "s")
    await trace.prepare([{"role": "user", "content": "idle"}], None)
    assert renderer.threads == [("idle", threading.current_thread().name)] and trace._worker is None
    slow = asyncio.create_task(trace.prepare([{"role": "user", "content": "slow"}], None, offload=True))
    await wait_until(lambda: len(renderer.threads) == 2, "the slow render is running in its thread")
    queued = [
        asyncio.create_task(trace.prepare([{"role": "user", "content": f"q{i}"}], None)) for i in range(3)
    ]
    await asyncio.wait_for(asyncio.gather(slow, *queued), 60)
    assert [text for text, _ in renderer.threads] == ["idle", "slow", "q0", "q1", "q2"]
    assert trace._worker is None
