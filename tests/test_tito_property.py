"""Property: whatever an agent does to its history (continue, call tools, rewrite, summarize, drop turns,
repeat a request), composed samples never mark a token trainable that was not sampled exactly there, and
every sampled token is trainable in exactly one sample."""

from __future__ import annotations

import asyncio
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollflow.tito import compose
from tests.helpers.tito import ScriptedClient, as_history_message, ask, make_session

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]


def _reply(thinking: bool):
    def reply(call: int, _request) -> str:
        think = f"<think>\nstep {call}\n</think>\n\n" if thinking else ""
        if call % 3 == 1:
            return think + f'<tool_call>\n{{"name": "add", "arguments": {{"n": {call}}}}}\n</tool_call>'
        return think + f"reply {call}"

    return reply


step = st.tuples(
    st.sampled_from(["user", "tool", "rewrite", "summarize", "drop", "repeat"]),
    st.integers(0, 1000),  # picks the base history and what to change
)


async def _run(chat, thinking: bool, steps: list[tuple[str, int]]):
    renderer = chat.renderer_with(enable_thinking=True) if thinking else chat.renderer
    client = ScriptedClient(chat.tokenizer, _reply(thinking))
    session = make_session(client, chat, renderer)
    histories = [[{"role": "system", "content": "sys"}, {"role": "user", "content": "start"}]]
    request = histories[0]
    for i, (kind, pick) in enumerate(steps):
        base = histories[pick % len(histories)]
        if kind == "user":
            request = [*base, {"role": "user", "content": f"user {i}"}]
        elif kind == "tool":
            request = [*base, {"role": "tool", "tool_call_id": "t", "content": f"result {i}"}]
        elif kind == "rewrite":
            request = [dict(m) for m in base]
            target = request[pick % len(request)]
            target["content"] = f"rewritten {i}"
            target.pop("tool_calls", None)
            request.append({"role": "user", "content": f"after rewrite {i}"})
        elif kind == "summarize":
            request = [base[0], {"role": "user", "content": f"summary {i}"}]
        elif kind == "drop":
            request = base[: max(2, len(base) - 2 * (1 + pick % 2))]
            if request[-1]["role"] == "assistant":
                request.append({"role": "user", "content": f"redo {i}"})
        # "repeat": send the previous request again (a legitimate new request, not a retry)
        turn = await ask(session, request, tools=TOOLS)
        histories.append([*request, as_history_message(turn)])
    session.trace.sealed = True
    return session.trace, client


def _identify(logprob: float) -> tuple[int, int]:
    """(call, position) from the scripted logprob -(call + 1) - position / 1000."""
    call = math.floor(-logprob + 1e-9) - 1
    return call, round((-logprob - (call + 1)) * 1000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(thinking=st.booleans(), steps=st.lists(step, min_size=1, max_size=7))
def test_trainable_tokens_are_exactly_the_sampled_ones(tiny_chat, thinking, steps):
    trace, client = asyncio.run(_run(tiny_chat, thinking, steps))
    claimed: list[tuple[int, int]] = []
    for sample in compose(trace, reward=1.0, mode="per_branch", max_seq_len=100_000):
        full = sample.prompt_token_ids + sample.completion_token_ids
        offset = len(sample.prompt_token_ids)
        for i, (logprob, trained) in enumerate(zip(sample.logprobs, sample.loss_mask, strict=True)):
            if not trained:
                continue
            call, position = _identify(logprob)
            prompt = client.requests[call].prompt_token_ids
            sampled = client.outputs[call].token_ids
            start = offset + i - position
            # The token, everything sampled before it in that call, and that call's prompt are all in place.
            assert start == len(prompt) and full[:start] == prompt
            assert full[start : offset + i + 1] == sampled[: position + 1]
            claimed.append((call, position))
    every_sampled = [(call, p) for call, out in enumerate(client.outputs) for p in range(len(out.token_ids))]
    assert sorted(claimed) == every_sampled  # each sampled token trainable exactly once

    steps_samples = compose(trace, reward=1.0, mode="step_wise", max_seq_len=100_000)
    assert len(steps_samples) == len(client.outputs)
