"""The trace's cost per turn does not grow with the conversation, and its storage stays compact.

Work is counted (message comparisons, tokens handed to the renderer), not timed, so these hold on a busy
machine; ``benchmarks/tito_turns.py`` and ``benchmarks/tito_load.py`` measure the time and bytes.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from rollflow.tito.store import NodeStore
from rollflow.tito.trace import Sampled, Trace
from tests.helpers.tito import ScriptedClient, as_history_message, ask, make_session

pytestmark = pytest.mark.asyncio

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]


def _tool_reply(call: int, _request) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"n": {call}}}}}\n</tool_call>'


class _Counting:
    """Wraps a session's renderer and store to count the work each turn does."""

    def __init__(self, session, monkeypatch):
        self.comparisons = 0
        self.bridge_prompt_lengths: list[int] = []
        store_matches = NodeStore.matches
        renderer = session.trace.renderer
        renderer_bridge = renderer.bridge

        def matches(store, *args):
            self.comparisons += 1
            return store_matches(store, *args)

        def bridge(prompt_ids, completion_ids, new_messages, tools):
            self.bridge_prompt_lengths.append(len(prompt_ids) + len(completion_ids))
            return renderer_bridge(prompt_ids, completion_ids, new_messages, tools)

        monkeypatch.setattr(NodeStore, "matches", matches)
        monkeypatch.setattr(renderer, "bridge", bridge)


async def test_work_per_turn_does_not_grow_with_the_history(tiny_chat, monkeypatch):
    client = ScriptedClient(tiny_chat.tokenizer, _tool_reply)
    session = make_session(client, tiny_chat)
    counting = _Counting(session, monkeypatch)
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "count"}]
    comparisons = []
    for call in range(40):
        before = counting.comparisons
        turn = await ask(session, history, tools=TOOLS)
        comparisons.append(counting.comparisons - before)
        assert call == 0 or turn.render.method == "bridge"
        history += [
            as_history_message(turn),
            {"role": "tool", "tool_call_id": "t", "content": f"result {call}"},
        ]
    # Each request is matched by following the previous turn: one comparison (its reply), no tree walk.
    assert session.trace.stats.followed == 39
    assert set(comparisons[1:]) == {1}
    # The renderer sees the previous model turn and what follows it, never the whole history.
    lengths = counting.bridge_prompt_lengths
    assert max(lengths[1:]) - min(lengths[1:]) <= 4, lengths
    assert len(client.requests[-1].prompt_token_ids) > 20 * max(lengths[1:])


async def test_an_edited_earlier_message_is_matched_again_and_forks(tiny_chat):
    session = make_session(ScriptedClient(tiny_chat.tokenizer, _tool_reply), tiny_chat)
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "count"}]
    turns = []
    for call in range(3):
        turns.append(await ask(session, history, tools=TOOLS))
        history += [
            as_history_message(turns[-1]),
            {"role": "tool", "tool_call_id": "t", "content": str(call)},
        ]
    followed = session.trace.stats.followed
    edited = [history[0], {"role": "user", "content": "count again"}, *history[2:]]
    rewritten = await ask(session, edited, tools=TOOLS)
    assert (rewritten.render.method, rewritten.render.outcome) == ("full", "forked")
    # The next request continues the original branch, not the last committed one: found by a walk.
    again = await ask(session, history, tools=TOOLS)
    assert again.render.method == "bridge" and again.node.parent.parent == turns[-1].node
    assert session.trace.stats.followed == followed
    assert len(session.trace.leaves()) == 2


@pytest.mark.parametrize("thinking", [False, True])
async def test_bridge_from_the_previous_turn_equals_bridge_from_the_whole_prompt(tiny_chat, thinking):
    renderer = tiny_chat.renderer_with(enable_thinking=True) if thinking else tiny_chat.renderer

    def reply(call, request):
        think = f"<think>\nstep {call}\n</think>\n\n" if thinking else ""
        return think + (_tool_reply(call, request) if call % 2 == 0 else f"answer {call}")

    client = ScriptedClient(tiny_chat.tokenizer, reply)
    session = make_session(client, tiny_chat, renderer)
    history = [{"role": "user", "content": "go"}]
    turns = []
    for call in range(6):
        turn = await ask(session, history, tools=TOOLS)
        turns.append(turn)
        follow = {"role": "tool", "tool_call_id": "t", "content": f"r{call}"} if call % 2 == 0 else None
        history += [as_history_message(turn), follow or {"role": "user", "content": f"next {call}"}]
    bridged = [i for i, turn in enumerate(turns) if turn.render.method == "bridge"]
    assert bridged
    for i in bridged:
        anchor = turns[i - 1].node
        prompt = client.requests[i - 1].prompt_token_ids
        completion = client.outputs[i - 1].token_ids
        whole = session.trace.renderer.bridge(prompt, completion, _new_messages(turns[i], anchor), _tools())
        assert whole is not None and client.requests[i].prompt_token_ids == whole.token_ids
    # Replies are parsed from the prompt's tail too (from the previous sampled turn on): the recorded
    # messages equal a parse against the whole prompt.
    for i, turn in enumerate(turns):
        full = session.trace.renderer.parse(
            client.outputs[i].token_ids, _tools(), client.requests[i].prompt_token_ids
        )
        recorded = turn.node.message
        assert (recorded["content"], recorded.get("reasoning_content")) == (
            full.content,
            full.reasoning_content,
        )
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in recorded.get("tool_calls", [])]
        assert calls == full.tool_calls
        assert bool(full.reasoning_content) == thinking


def _new_messages(turn, anchor):
    path = turn.node.path()
    return [node.message for node in path[path.index(anchor) + 1 : -1]]


def _tools():
    import msgspec

    from rollflow.tito.renderer import normalize_tools
    from rollflow.tito.wire import Tool

    return normalize_tools([msgspec.convert(t, Tool) for t in TOOLS])


async def _branched_trace_bytes(chat, branches: int) -> tuple[int, int]:
    """Bytes a trace of ``branches`` branches off one prefix retains, and the bytes of its unique data."""
    from rollflow.tito.renderer import TITORenderer

    renderer = TITORenderer(chat.renderer, chat.tokenizer)
    reply = [*chat.tokenizer.encode("a reply", add_special_tokens=False), renderer.stop_token_ids[0]]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trace = Trace(renderer)
        base = [{"role": "user", "content": " ".join(f"w{i % 50}" for i in range(500))}]
        answer = {"role": "assistant", "content": "a reply"}
        for branch in range(branches + 1):
            messages = base if branch == 0 else [*base, answer, {"role": "user", "content": f"b {branch}"}]
            prepared = await trace.prepare(messages, None)
            sampled = Sampled(reply, [-0.5] * len(reply), [0] * len(reply), "stop")
            await trace.commit(prepared, sampled, answer, finish_reason="stop", response_id=str(branch))
        del prepared, base, messages
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    nodes = trace.nodes[1:]
    tokens = sum(len(node.token_ids) for node in nodes)
    sampled_tokens = sum(len(node.token_ids) - node.num_prompt for node in nodes if node.sampled)
    text = sum(len(trace._store.encoded_message(node.id)) for node in nodes)
    return used, tokens * 4 + sampled_tokens * 12 + text


@pytest.mark.slow
async def test_a_node_costs_its_data_and_a_few_dozen_bytes(tiny_chat):
    small, small_data = await _branched_trace_bytes(tiny_chat, 32)
    large, large_data = await _branched_trace_bytes(tiny_chat, 96)
    extra_nodes = 2 * 64
    overhead_per_node = ((large - small) - (large_data - small_data)) / extra_nodes
    assert overhead_per_node < 100, f"{overhead_per_node:.0f} bytes per node besides its tokens and text"


async def test_a_ragged_sampled_output_is_refused(tiny_chat):
    from rollflow.errors import EngineError

    session = make_session(ScriptedClient(tiny_chat.tokenizer), tiny_chat)
    prepared = await session.trace.prepare([{"role": "user", "content": "hi"}], None)
    ragged = Sampled([5, 6, 2], [-0.1, -0.2], [0, 0, 0], "stop")
    with pytest.raises(EngineError, match="3 tokens, 2 logprobs"):
        await session.trace.commit(
            prepared, ragged, {"role": "assistant", "content": "x"}, finish_reason="stop", response_id="r"
        )
    assert session.trace.turns == [] and len(session.trace.nodes) == 1
