"""``rollflow trace RUN``: one saved agent trace (``rollflow.tito.saved``) as a self-contained HTML page.

The page shows the session's message tree as nested lists: each node is one message with the token segment
it added, every token coloured trainable (sampled by the policy: trained on, with its logprob and policy
version on hover) or not trainable (rendered context: prompts, tool results, template scaffolding). Nodes
where the tree forks carry a ``fork`` badge with their number of branches, and a turn whose request forked
the tree says at which token position and why. It has no scripts and loads nothing: one file to open or
attach.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.tito.saved import TRACES_DIR, read_traces

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
ul.tree, ul.tree ul { list-style: none; padding-left: 1.4em; border-left: 1px solid #ccc; }
li.node { margin: .6em 0; }
li.node.fork > .head { border-left: 4px solid #c60; padding-left: .4em; }
.head { font-weight: 600; }
.badge { display: inline-block; font-size: .8em; font-weight: 600; padding: 0 .45em; margin-left: .4em;
  border-radius: .6em; background: #eee; }
.badge.fork { background: #fd9; } .badge.forked { background: #fcc; } .badge.bridge { background: #cfc; }
.reason { color: #666; font-weight: normal; font-size: .9em; }
.msg { white-space: pre-wrap; margin: .2em 0; color: #333; }
.tokens { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; word-break: break-all; }
.tok { border-radius: 2px; }
.trainable { background: #bde5bd; }
.context { background: #eceff3; color: #555; }
.fork-point { outline: 2px solid #c00; }
.legend span { margin-right: 1em; }
"""


def _escape(text: Any) -> str:
    return html.escape(str(text), quote=True)


def render_trace_page(record: dict[str, Any], decode: Callable[[int], str] | None = None) -> str:
    """The HTML page of one saved trace record; ``decode`` gives a token's text (default: its id)."""
    decode = decode or (lambda token_id: f"[{token_id}]")
    nodes = {node["id"]: node for node in record["nodes"]}
    children: dict[int, list[int]] = {}
    for node in record["nodes"]:
        children.setdefault(node["parent"], []).append(node["id"])
    turns_by_node: dict[int, list[dict[str, Any]]] = {}
    for turn in record["turns"]:
        turns_by_node.setdefault(turn["node"], []).append(turn)
    forks = set(record.get("forks", ()))
    # Conversation position of each node's first token, to place a turn's fork position on a token.
    starts: dict[int, int] = {0: 0}
    ends: dict[int, int] = {0: 0}
    for node in record["nodes"]:  # parents come before their children (ids are creation order)
        starts[node["id"]] = ends[node["parent"]]
        ends[node["id"]] = starts[node["id"]] + len(node["token_ids"])
    fork_positions: dict[int, set[int]] = {}  # node -> positions where the branches through it part
    for turn in record["turns"]:
        position = turn["render"].get("fork_position")
        if position is None:
            continue
        # The node of the new branch that covers the position, and its siblings that cover it too.
        node_id = turn["node"]
        while node_id and starts[node_id] > position:
            node_id = nodes[node_id]["parent"]
        if not node_id:
            continue
        for sibling in children.get(nodes[node_id]["parent"], ()):
            if starts[sibling] <= position < ends[sibling]:
                fork_positions.setdefault(sibling, set()).add(position)

    def tokens(node: dict[str, Any]) -> str:
        spans = []
        sampled_from = node["num_prompt"]
        logprobs = node.get("logprobs") or []
        versions = node.get("policy_versions") or []
        marks = fork_positions.get(node["id"], set())
        for offset, token_id in enumerate(node["token_ids"]):
            trainable = node["logprobs"] is not None and offset >= sampled_from
            title = f"token {token_id} at {starts[node['id']] + offset}"
            if trainable:
                index = offset - sampled_from
                title += f" · logprob {logprobs[index]:.4f} · policy v{versions[index]}"
            classes = "tok trainable" if trainable else "tok context"
            if starts[node["id"]] + offset in marks:
                classes += " fork-point"
                title += " · a later request forked here"
            spans.append(
                f'<span class="{classes}" title="{_escape(title)}">{_escape(decode(token_id))}</span>'
            )
        return "".join(spans)

    def item(node_id: int) -> str:
        node = nodes[node_id]
        message = node["message"] or {}
        head = [f"#{node_id} {_escape(message.get('role', '?'))}"]
        sampled = len(node["token_ids"]) - node["num_prompt"] if node["logprobs"] is not None else 0
        head.append(f'<span class="badge">{len(node["token_ids"])} tokens, {sampled} trainable</span>')
        if node_id in forks:
            head.append(f'<span class="badge fork">fork: {len(children[node_id])} branches</span>')
        for turn in turns_by_node.get(node_id, ()):
            render = turn["render"]
            kind = (
                "forked"
                if render["outcome"] == "forked"
                else "bridge"
                if render["method"] == "bridge"
                else ""
            )
            label = f"turn {turn['index']}: {render['method']} render, {render['outcome']}"
            if render.get("fork_position") is not None:
                label += f" at token {render['fork_position']}"
            options = turn.get("options") or {}
            if options:
                label += " · " + ", ".join(f"{key}={json.dumps(value)}" for key, value in options.items())
            head.append(f'<span class="badge {kind}">{_escape(label)}</span>')
            head.append(f'<span class="reason">{_escape(render["reason"])}</span>')
        text = message.get("content") or ""
        if message.get("tool_calls"):
            text += "\n" + json.dumps(message["tool_calls"])
        body = f'<div class="head">{" ".join(head)}</div>'
        body += f'<div class="msg">{_escape(text)}</div><div class="tokens">{tokens(node)}</div>'
        kids = children.get(node_id, [])
        if kids:
            body += "<ul>" + "".join(item(child) for child in kids) + "</ul>"
        classes = "node fork" if node_id in forks else "node"
        return f'<li class="{classes}" id="node-{node_id}" data-node="{node_id}">{body}</li>'

    def link(node_id: int) -> str:
        return f'<a href="#node-{node_id}">#{node_id}</a>'

    branches = "".join(
        "<li>" + " → ".join(link(node_id) for node_id in branch) + "</li>"
        for branch in record.get("branches", ())
    )
    stats = record.get("stats", {})
    outcome = record.get("mask_reason") or record.get("error") or "ok"
    summary = (
        f"prompt {record.get('prompt_index')}, trajectory {record.get('sample_index')}, reward "
        f"{record.get('reward')}, {stats.get('turns', len(record['turns']))} turns, "
        f"{len(record.get('branches', ()))} branches, {len(forks)} forks, outcome: {outcome}"
    )
    # The conversation's start is the root: the tree forks there when the first messages were re-rendered
    # into other tokens (e.g. the tools, rendered into the system message, changed).
    root_badge = f'<span class="badge fork">fork: {len(children[0])} branches</span>' if 0 in forks else ""
    roots = "".join(item(child) for child in children.get(0, []))
    roots = (
        f'<li class="{"node fork" if 0 in forks else "node"}" id="node-0" data-node="0"><div class="head">'
        f"conversation start {root_badge}</div><ul>{roots}</ul></li>"
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>trace {_escape(record.get('session_id', ''))}</title><style>{_STYLE}</style></head><body>"
        f"<h1>Agent session {_escape(record.get('session_id', ''))}</h1>"
        f'<p class="summary">{_escape(summary)}</p>'
        '<p class="legend"><span class="key trainable">trainable</span><span class="key context">not '
        'trainable</span><span class="key badge fork">fork</span><span class="key fork-point">fork point</span></p>'
        f'<h2>Branches</h2><ol class="branches">{branches}</ol>'
        f'<h2>Message tree</h2><ul class="tree">{roots}</ul></body></html>\n'
    )


def choose_trace(
    records: list[dict[str, Any]], *, session: str | None = None, prompt: int | None = None
) -> dict[str, Any]:
    """The record of ``session``, else the first of ``prompt`` (or of any prompt) that forks, else the first.

    Raises:
        LookupError: no record matches.
    """
    if session is not None:
        matches = [r for r in records if r.get("session_id") == session]
    else:
        matches = [r for r in records if prompt is None or r.get("prompt_index") == prompt]
    if not matches:
        raise LookupError(
            f"no saved trace for session {session!r}" if session else f"no saved trace for prompt {prompt}"
        )
    return next((r for r in matches if r.get("forks")), matches[0])


def write_trace_page(
    run_dir: str | os.PathLike[str],
    *,
    session: str | None = None,
    prompt: int | None = None,
    output: str | os.PathLike[str] | None = None,
) -> Path:
    """Render one saved trace of a run (see ``choose_trace``) to ``output`` (default
    ``{run_dir}/traces/{session_id}.html``), decoding tokens with the run's tokenizer when it loads.

    Raises:
        FileNotFoundError: the run saved no traces.
        LookupError: no trace matches ``session`` or ``prompt``.
    """
    run_dir = Path(run_dir)
    record = choose_trace(read_traces(run_dir / TRACES_DIR), session=session, prompt=prompt)
    page = render_trace_page(record, _decoder(record.get("model"), run_dir))
    path = Path(output) if output is not None else run_dir / TRACES_DIR / f"{record['session_id']}.html"
    path.write_text(page, encoding="utf-8")
    return path


def _decoder(model: str | None, run_dir: Path) -> Callable[[int], str] | None:
    """Token text by the tokenizer of the trace's model (else the run's ``config.json`` ``model.path``), or
    None when it cannot be loaded (the page then shows token ids)."""
    try:
        if model is None:
            model = json.loads((run_dir / "config.json").read_text())["model"]["path"]
        from rollflow.models.loading import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(model))
    except Exception:  # no config or no local model: token ids are shown instead
        return None
    return lambda token_id: tokenizer.decode([token_id])
