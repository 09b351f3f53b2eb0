"""Rendering against the trace: bridge when safe, full render otherwise, forks where tokens differ."""

from __future__ import annotations

import numpy as np
import pytest

from rollflow.tito import RoutedExpertsError, compose
from rollflow.tito.trace import Sampled
from tests.helpers.tito import ScriptedClient, as_history_message, ask, make_session

pytestmark = pytest.mark.asyncio

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]
TOOL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_user_and_tool_turns_bridge_without_thinking(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer, lambda call, _: TOOL_REPLY if call == 0 else f"done {call}")
    session = make_session(client, tiny_chat)
    history = [{"role": "system", "content": "sys"}, _user("add 1 and 2")]
    first = await ask(session, history, tools=TOOLS)
    assert first.finish_reason == "tool_calls"
    (call,) = first.message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    history += [as_history_message(first), {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
    second = await ask(session, history, tools=TOOLS)
    history += [as_history_message(second), _user("thanks")]
    third = await ask(session, history, tools=TOOLS)
    assert [t.render.method for t in (first, second, third)] == ["full", "bridge", "bridge"]
    # Every prompt starts with the exact tokens sampled before it.
    for before, after in zip(client.requests, client.requests[1:], strict=False):
        output = client.outputs[client.requests.index(before)]
        assert after.prompt_token_ids[: len(before.prompt_token_ids) + len(output.token_ids)] == (
            before.prompt_token_ids + output.token_ids
        )
    # A bridged prompt equals the full render here (no drift for this template).
    full = session.trace.renderer.render(_normalized(history), _tools())
    assert client.requests[-1].prompt_token_ids == full.token_ids
    assert len(session.trace.leaves()) == 1


def _normalized(history):
    import msgspec

    from rollflow.tito.renderer import normalize_message
    from rollflow.tito.wire import ChatMessage

    return [normalize_message(msgspec.convert(m, ChatMessage)) for m in history]


def _tools():
    import msgspec

    from rollflow.tito.renderer import normalize_tools
    from rollflow.tito.wire import Tool

    return normalize_tools([msgspec.convert(t, Tool) for t in TOOLS])


async def test_thinking_user_turn_full_renders_and_forks_but_tool_turn_bridges(tiny_chat):
    renderer = tiny_chat.renderer_with(enable_thinking=True)
    replies = ["<think>\nplan it\n</think>\n\n" + TOOL_REPLY, "<think>\nok\n</think>\n\nthree", "bye"]
    client = ScriptedClient(tiny_chat.tokenizer, lambda call, _: replies[call])
    session = make_session(client, tiny_chat, renderer)
    history = [_user("add")]
    first = await ask(session, history, tools=TOOLS)
    assert first.message["reasoning_content"] == "plan it"
    history += [as_history_message(first), {"role": "tool", "tool_call_id": "x", "content": "3"}]
    second = await ask(session, history, tools=TOOLS)
    assert second.render.method == "bridge"
    history += [as_history_message(second), _user("next")]
    third = await ask(session, history, tools=TOOLS)
    # Qwen3 drops old thinking at a new user query: the render differs from what was sampled.
    assert (third.render.method, third.render.outcome) == ("full", "forked")
    assert "declined" in third.render.reason
    position = third.render.fork_position
    assert client.requests[2].prompt_token_ids[:position] == client.requests[1].prompt_token_ids[:position]
    assert len(session.trace.leaves()) == 2
    samples = compose(session.trace, reward=1.0, max_seq_len=1024)
    trained = sum(sum(s.loss_mask) for s in samples)
    assert trained == sum(len(o.token_ids) for o in client.outputs)


async def test_changed_tools_and_rewritten_history_render_fully(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    session = make_session(client, tiny_chat)
    history = [_user("one")]
    first = await ask(session, history)
    history += [as_history_message(first), _user("two")]
    second = await ask(session, history, tools=TOOLS)
    assert (second.render.method, second.render.reason) == ("full", "tools changed since the recorded turn")
    assert second.render.outcome == "forked" and second.render.fork_position is not None
    summary = await ask(session, [_user("summary of one and two")])
    assert (summary.render.method, summary.render.outcome) == ("full", "new")
    edited = [_user("one"), {"role": "assistant", "content": "not what was said"}, _user("two")]
    rewritten = await ask(session, edited)
    assert (rewritten.render.method, rewritten.render.outcome) == ("full", "forked")
    assert rewritten.render.reason == "no recorded sampled turn matches the history"
    # The rewritten assistant turn is context in its branch, never trainable.
    assert not rewritten.node.parent.parent.sampled
    assert len(session.trace.leaves()) == 4


async def test_dropped_reasoning_still_bridges_and_wrong_reasoning_does_not(tiny_chat):
    renderer = tiny_chat.renderer_with(enable_thinking=True)
    replies = ["<think>\nhmm\n</think>\n\n" + TOOL_REPLY, "a", "b"]
    client = ScriptedClient(tiny_chat.tokenizer, lambda call, _: replies[call])
    session = make_session(client, tiny_chat, renderer)
    first = await ask(session, [_user("x")], tools=TOOLS)
    tool = {"role": "tool", "tool_call_id": "x", "content": "3"}
    dropped = await ask(session, [_user("x"), as_history_message(first), tool], tools=TOOLS)
    assert dropped.render.method == "bridge"
    wrong = as_history_message(first) | {"reasoning_content": "something else"}
    other = await ask(session, [_user("x"), wrong, tool], tools=TOOLS)
    assert other.render.method == "full"


async def test_routed_experts_are_sliced_per_node_and_composed(tiny_chat):
    session = make_session(ScriptedClient(tiny_chat.tokenizer), tiny_chat)
    trace = session.trace
    prepared = await trace.prepare([{"role": "user", "content": "hi"}], None)
    total = len(prepared.prompt_ids) + 3
    experts = np.arange((total - 1) * 2 * 4).reshape(total - 1, 2, 4)  # the last position omitted
    sampled = Sampled([5, 6, 2], [-0.1, -0.2, -0.3], [0, 0, 0], "stop", experts)
    message = {"role": "assistant", "content": "x"}
    await trace.commit(prepared, sampled, message, finish_reason="stop", response_id="r")
    (sample,) = compose(trace, reward=1.0, max_seq_len=100)
    assert sample.routed_experts.shape == (total, 2, 4) and sample.routed_experts.dtype == np.int32
    assert (sample.routed_experts[:-1] == experts).all() and (sample.routed_experts[-1] == experts[-1]).all()
    for bad in (experts[:-2], experts.astype(np.float32), experts[:, 0]):
        prepared = await trace.prepare([{"role": "user", "content": "hi"}], None)
        with pytest.raises(RoutedExpertsError):
            await trace.commit(
                prepared,
                Sampled([5, 6, 2], [0.0] * 3, [0] * 3, "stop", bad),
                message,
                finish_reason="stop",
                response_id="r",
            )
