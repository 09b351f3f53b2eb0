"""Proxy-side cost per turn as one conversation grows, against re-rendering the history every turn.

One agent conversation of ``--turns`` turns (assistant reply, then a tool result) runs through a TITO
``Session`` whose client returns scripted tokens, so only proxy work is timed:
- ``rollflow_render_commit_ms``: the trace's prepare (bridge or render), the prompt as the ``list[int]`` an
  engine request takes, parsing the reply and the commit of the turn;
- ``prompt_list_ms``: the part of it spent turning the trace's int32 prompt into that list (a copy of the
  whole prompt, so it grows with the history);
- ``rollflow_request_ms``: the same plus normalizing the request's messages (what a real request adds);
- ``baseline_full_render_ms``: ``tokenizer.apply_chat_template`` of the whole history (what a proxy that
  re-renders each turn pays), measured on the same histories in the same process, in a pass after the
  conversation (interleaved, its large renders would evict the caches of rollflow's next turn).
Each figure is the median over the turns within ±``--window`` of the reported turn and over ``--repeats``
conversations. Target: turn 200 costs at most 1.5x turn 1 for rollflow, while the baseline grows.

What still grows with the history in ``rollflow_render_commit_ms``, by design: checking that the request
repeats the previous one (one msgspec encode and one SHA-256 of the request, in C), one memcpy of the
recorded tokens into the new prompt, and the prompt list.

Prints one JSON line per reported turn:
{"benchmark": "tito_turns", "turn": 200, "rollflow_render_commit_ms": ..., "rollflow_request_ms": ...,
 "baseline_full_render_ms": ..., "rollflow_vs_turn1": ..., "baseline_vs_turn1": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOOL_REPLY = (
    '<tool_call>\n{{"name": "lookup", "arguments": {{"query": "item {n}", "page": {n}}}}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
]


async def conversation(chat, turns: int) -> dict[int, tuple[float, ...]]:
    import msgspec

    from rollflow.tito.renderer import normalize_message, normalize_tools
    from rollflow.tito.session import _assistant_message
    from rollflow.tito.testing import as_history_message, make_session
    from rollflow.tito.trace import Sampled
    from rollflow.tito.wire import ChatCompletionRequest

    session = make_session(None, chat)
    trace, renderer = session.trace, session.trace.renderer
    history: list[dict] = [
        {"role": "system", "content": "You look things up with the lookup tool."},
        {"role": "user", "content": "Find the items one after another."},
    ]
    timings = {}
    for turn in range(1, turns + 1):
        request = msgspec.convert({"model": "m", "messages": history, "tools": TOOLS}, ChatCompletionRequest)
        completion = [
            *chat.tokenizer.encode(TOOL_REPLY.format(n=turn), add_special_tokens=False),
            renderer.stop_token_ids[0],
        ]
        sampled = Sampled(completion, [-0.5] * len(completion), [0] * len(completion), "stop")

        start = time.perf_counter()
        messages = [normalize_message(m) for m in request.messages]
        tools = normalize_tools(request.tools)
        normalized = time.perf_counter()
        prepared = await trace.prepare(messages, tools)
        prepared_at = time.perf_counter()
        prompt_ids = prepared.prompt_ids  # what the engine request takes
        listed = time.perf_counter()
        parsed = renderer.parse(completion, tools, prepared.parse_prompt_ids)
        message, finish = _assistant_message(parsed, "stop")
        committed = await trace.commit(
            prepared, sampled, message, finish_reason=finish, response_id=str(turn)
        )
        end = time.perf_counter()
        assert len(prompt_ids) == len(prepared.prompt)
        assert turn == 1 or committed.render.method == "bridge", committed.render
        timings[turn] = ((end - normalized) * 1e3, (end - start) * 1e3, (listed - prepared_at) * 1e3)
        call_id = message["tool_calls"][0]["id"]
        history += [
            as_history_message(committed),
            {"role": "tool", "tool_call_id": call_id, "content": f"item {turn}: found on shelf {turn % 7}"},
        ]

    # The baseline renders the same histories in a pass of its own: run between rollflow's turns, its
    # render of the whole history (milliseconds, megabytes of garbage) would evict the caches rollflow's
    # next turn runs in, a cost that grows with the history but is not rollflow's.
    for turn in range(1, turns + 1):
        baseline_start = time.perf_counter()
        chat.tokenizer.apply_chat_template(
            history[: 2 * turn],
            tools=[t["function"] for t in TOOLS],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        timings[turn] += ((time.perf_counter() - baseline_start) * 1e3,)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--report", default="1,50,100,200")
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rollflow.tito.testing import load_tiny_chat

    chat = load_tiny_chat()
    runs = [asyncio.run(conversation(chat, args.turns)) for _ in range(args.repeats + 1)][
        1:
    ]  # first: warm-up

    def figure(turn: int, column: int) -> float:
        turns = range(max(1, turn - args.window), min(args.turns, turn + args.window) + 1)
        return statistics.median(run[t][column] for run in runs for t in turns)

    reported = [int(t) for t in args.report.split(",")]
    first = [figure(reported[0], c) for c in range(4)]
    for turn in reported:
        render_commit, request, prompt_list, baseline = (figure(turn, c) for c in range(4))
        line = {
            "benchmark": "tito_turns",
            "turn": turn,
            "rollflow_render_commit_ms": round(render_commit, 4),
            "prompt_list_ms": round(prompt_list, 4),
            "rollflow_request_ms": round(request, 4),
            "baseline_full_render_ms": round(baseline, 4),
            "rollflow_vs_turn1": round(render_commit / first[0], 3),
            "rollflow_request_vs_turn1": round(request / first[1], 3),
            "baseline_vs_turn1": round(baseline / first[3], 3),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
