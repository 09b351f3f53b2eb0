"""Agent traces kept with a run (``agent.save_traces``) and ``rollflow trace RUN``'s HTML page, checked by
parsing the page: every token coloured by whether it is trained, forks marked, nothing loaded from outside."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rollflow.errors import ConfigError
from rollflow.messages import RolloutRequest
from rollflow.rollout.agent import AgentGenerator
from rollflow.tito import TITOProxy
from rollflow.tito.saved import TraceWriter, read_traces
from rollflow.tito.trace_page import render_trace_page
from tests.helpers.tito import MODEL

from .conftest import REPO_ROOT

EXAMPLE_AGENT = REPO_ROOT / "examples" / "agent_tito" / "agent.py"


async def _example_group(client, tiny_chat, writer, prompt_index=5, num_samples=2):
    from rollflow.imports import import_object

    agent = import_object(f"{EXAMPLE_AGENT}:run_agent", key="agent.callable")
    item = import_object(f"{EXAMPLE_AGENT}:ArithmeticTask", key="data.task")(0).item(prompt_index)
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=8
    ) as proxy:
        generator = AgentGenerator(proxy, agent, max_seq_len=1024, timeout_s=60, trace_writer=writer)
        request = RolloutRequest(
            prompt_index=prompt_index, messages=item.messages, answer=item.answer, num_samples=num_samples
        )
        return await generator.generate_group(request)


class _Page(HTMLParser):
    """What the checks read from a page: token spans by class, fork badges, external references."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, int] = {"trainable": 0, "context": 0}
        self.fork_badges = 0
        self.fork_points = 0
        self.fork_nodes: list[str] = []
        self.external: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        classes = (attrs.get("class") or "").split()
        if tag == "span" and "tok" in classes:
            self.tokens["trainable" if "trainable" in classes else "context"] += 1
            self.fork_points += "fork-point" in classes and "title" in attrs
        if tag == "span" and classes == ["badge", "fork"]:
            self.fork_badges += 1
        if tag == "li" and "fork" in classes:
            self.fork_nodes.append(attrs["data-node"])
        for name in ("src", "href"):
            if name in attrs and not attrs[name].startswith("#"):
                self.external.append(attrs[name])


async def test_saved_traces_and_their_page(inference_client, tiny_chat, tmp_path):
    writer = TraceWriter(tmp_path / "traces", "all")
    group = await _example_group(inference_client, tiny_chat, writer)
    (file,) = (tmp_path / "traces").glob("*.jsonl")
    assert file.name == "p000005.jsonl"
    records = read_traces(tmp_path / "traces")
    assert [r["sample_index"] for r in records] == [0, 1]
    for record in records:
        # The example summarizes its history without its tools: two branches, forked at the conversation's
        # start (the tools are rendered into the system message), three turns.
        assert len(record["branches"]) == 2 and record["forks"] == [0] and len(record["turns"]) == 3
        assert [t["render"]["outcome"] for t in record["turns"]].count("forked") == 1
        sampled = [n for n in record["nodes"] if n["logprobs"] is not None]
        assert all(len(n["policy_versions"]) == len(n["token_ids"]) - n["num_prompt"] for n in sampled)
        rewards = {s.reward for s in group.samples if s.trajectory == record["sample_index"]}
        assert rewards == {record["reward"]}

        page = _Page()
        page.feed(
            render_trace_page(
                record, tiny_chat.tokenizer.decode and (lambda t: tiny_chat.tokenizer.decode([t]))
            )
        )
        trainable = sum(len(n["token_ids"]) - n["num_prompt"] for n in sampled)
        assert page.tokens["trainable"] == trainable
        assert page.tokens["context"] == sum(len(n["token_ids"]) for n in record["nodes"]) - trainable
        assert page.fork_badges == 1 and page.fork_nodes == [str(f) for f in record["forks"]]
        assert page.fork_points >= 1  # where the rewritten history parts from the recorded one
        assert page.external == [] and "script" not in page.tags and "link" not in page.tags
    # Every trained token of the samples is on a page as trainable, once.
    assert sum(sum(s.loss_mask) for s in group.samples) == sum(
        len(n["token_ids"]) - n["num_prompt"]
        for r in records
        for n in r["nodes"]
        if n["logprobs"] is not None
    )


async def test_sampled_keeps_one_trajectory_per_group_and_write_failures_are_counted(
    inference_client, tiny_chat, tmp_path, monkeypatch
):
    writer = TraceWriter(tmp_path / "traces", "sampled")
    await _example_group(inference_client, tiny_chat, writer, prompt_index=1, num_samples=3)
    assert [r["sample_index"] for r in read_traces(tmp_path / "traces")] == [0]

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_group", fail)
    group = await _example_group(inference_client, tiny_chat, writer, prompt_index=2, num_samples=2)
    assert group.metrics["agent_trace_write_errors"] == 1 and len(group.samples) == 4  # samples kept


def test_unwritable_trace_directory_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="agent.save_traces"):
        TraceWriter(blocker / "traces", "all")


def test_rollflow_trace_cli(tmp_path, capsys):
    from rollflow.cli import main

    run = tmp_path / "run"
    assert main(["trace", str(run)]) == 2
    assert "save_traces" in capsys.readouterr().err
    (run / "traces").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"path": "rollflow:tiny"}}))
    record = {
        "session_id": "s-1",
        "prompt_index": 0,
        "sample_index": 0,
        "reward": 0.5,
        "nodes": [
            {
                "id": 1,
                "parent": 0,
                "message": {"role": "user", "content": "hi"},
                "token_ids": [5, 6],
                "num_prompt": 2,
                "logprobs": None,
                "policy_versions": None,
                "finish_reason": None,
            },
            {
                "id": 2,
                "parent": 1,
                "message": {"role": "assistant", "content": "yo"},
                "token_ids": [7, 8, 9],
                "num_prompt": 1,
                "logprobs": [-0.5, -0.25],
                "policy_versions": [3, 3],
                "finish_reason": "stop",
            },
        ],
        "turns": [
            {
                "index": 0,
                "node": 2,
                "render": {"method": "full", "outcome": "new", "reason": "r", "fork_position": None},
                "options": {},
            }
        ],
        "branches": [[1, 2]],
        "forks": [],
        "stats": {"turns": 1},
    }
    (run / "traces" / "p000000.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["trace", str(run)]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith("s-1.html")
    page = _Page()
    page.feed(Path(path).read_text(encoding="utf-8"))
    assert page.tokens == {"trainable": 2, "context": 3}
    assert main(["trace", str(run), "--session", "nobody"]) == 2
