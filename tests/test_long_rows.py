"""Dataset rows whose prompt cannot fit ``inference.max_model_len``: skipped (counted, logged with their line)
or refused with a clear error per ``data.on_bad_row``; a huge row is refused by its length before it is
tokenized; and every message names a JSONL row the same way (``line L, row R``)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rollflow import Orchestrator, load_config
from rollflow.config import RunConfig
from rollflow.errors import ConfigError, PromptTooLongError, RemoteContextLengthExceededError
from rollflow.messages import RolloutRequest
from rollflow.rollout import generator as generator_module
from rollflow.rollout.datasets import task_from_config
from rollflow.rollout.generator import PROMPT_TOO_LONG, PromptLimit, SingleTurnGenerator
from rollflow.rollout.rewards import Rewarder
from rollflow.rollout.tasks import CaseTask

LONG_ROW = 3  # row index of the overlong prompt; with a blank line before it, its file line is 5


def write_rows(path: Path, long_prompt: str, count: int = 6) -> Path:
    """``count`` quickstart rows as JSONL with a blank second line; row ``LONG_ROW`` gets ``long_prompt``."""
    task = CaseTask(0)
    rows = [
        {"prompt": task.item(i).messages[0]["content"], "answer": task.item(i).answer} for i in range(count)
    ]
    rows[LONG_ROW]["prompt"] = long_prompt
    lines = [json.dumps(row) for row in rows]
    lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_config(tmp_path: Path, data_path: Path, *overrides: str) -> RunConfig:
    return load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=long",
            f"data.path='{data_path}'",
            "data.reward='case'",
            "data.shuffle=false",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            "orchestrator.prompts_per_step=6",
            "orchestrator.steps=1",
            "inference.router_port=0",  # runs in http mode start a router; tests run side by side
            *overrides,
        ],
    )


@pytest.fixture
def warnings(monkeypatch) -> list[dict]:
    """The generator module's warnings (its own logger: one cached by an earlier test escapes capture_logs)."""
    logged: list[dict] = []
    monkeypatch.setattr(
        generator_module.log, "warning", lambda event, **fields: logged.append({"event": event, **fields})
    )
    return logged


@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE (nox -s tests_http: over HTTP)
async def test_a_row_longer_than_the_context_is_skipped_counted_and_logged_with_its_line(tmp_path, warnings):
    # 1,500 tokens' worth of text against max_model_len 1024: it renders fine, then cannot fit.
    path = write_rows(tmp_path / "rows.jsonl", "hello " * 1500)
    config = run_config(tmp_path, path, "data.on_bad_row='skip'")
    async with Orchestrator(config) as orchestrator:
        [metrics] = await orchestrator.run()
    assert metrics["skipped_prompts"] == 1
    assert metrics["num_masked_samples"] == 2 and metrics["num_samples"] == 12
    # Generation runs ahead of training: the next epoch's turn of the row may be skipped (and logged) too.
    skip, *_ = [entry for entry in warnings if entry["event"].startswith("prompt does not fit")]
    assert skip["line"] == LONG_ROW + 2 and skip["row"] == LONG_ROW
    assert f"line {LONG_ROW + 2}, row {LONG_ROW}" in skip["where"] and "renders to" in skip["problem"]
    rollouts = [json.loads(line) for line in (config.run_dir / "rollouts.jsonl").read_text().splitlines()]
    skipped = [r for r in rollouts if r["prompt_index"] == LONG_ROW]
    assert skipped[0]["masked"] == [True, True]


async def test_a_row_longer_than_the_context_fails_the_run_naming_its_line_by_default(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", "hello " * 1500)
    config = run_config(tmp_path, path)
    async with Orchestrator(config) as orchestrator:
        # The error itself, not an exception group of the engine's refusals.
        with pytest.raises(PromptTooLongError) as raised:
            await orchestrator.run()
    message = str(raised.value)
    assert f"line {LONG_ROW + 2}, row {LONG_ROW}" in message and str(path) in message
    assert "inference.max_model_len = 1024" in message and "data.on_bad_row = 'skip'" in message
    assert isinstance(raised.value, ConfigError)  # the CLI: "config error: ...", exit 2


async def test_a_huge_row_fails_at_start_up_by_its_length_without_tokenizing(tmp_path, monkeypatch):
    path = write_rows(tmp_path / "rows.jsonl", "x" * 10_000_000)
    rendered: list[int] = []
    render = SingleTurnGenerator.render_prompt
    monkeypatch.setattr(
        SingleTurnGenerator,
        "render_prompt",
        lambda self, messages: rendered.append(len(messages[0]["content"])) or render(self, messages),
    )
    with pytest.raises(
        PromptTooLongError,
        match=rf"line {LONG_ROW + 2}, row {LONG_ROW}: the prompt's text has 10,000,000 characters",
    ):
        await Orchestrator.start(run_config(tmp_path, path))
    assert rendered == []


class Recording:
    """The tiny model's renderer, recording the length of the text of each prompt it renders."""

    def __init__(self, renderer: Any):
        self.renderer = renderer
        self.rendered: list[int] = []
        self.threads: list[str] = []

    def render_ids(self, messages: list[dict], **kwargs: Any) -> list[int]:
        self.rendered.append(sum(len(m["content"]) for m in messages))
        self.threads.append(threading.current_thread().name)
        return self.renderer.render_ids(messages, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.renderer, name)


class RefusingClient:
    """An inference client whose server answers every request with ``context_length_exceeded`` (a vLLM
    server counts ``max_tokens`` in; its context may also be smaller than ours)."""

    def __init__(self) -> None:
        self.requests = 0

    async def generate(self, request: Any) -> Any:
        self.requests += 1
        raise RemoteContextLengthExceededError(
            "This model's maximum context length is 512 tokens",
            url="http://127.0.0.1:1/v1/completions",
            status=400,
        )


@pytest.fixture(scope="module")
def chat():
    from rollflow.orchestrator.builders import load_chat

    return load_chat(RunConfig())


def make_generator(chat, client: Any, on_bad_row: str = "skip") -> tuple[SingleTurnGenerator, Recording]:
    tokenizer, renderer = chat
    recording = Recording(renderer)
    config = RunConfig()
    limit = PromptLimit(config.inference.max_model_len, tokenizer, on_bad_row=on_bad_row)  # type: ignore[arg-type]
    rewarder = Rewarder(lambda completion, item: 1.0)
    generator = SingleTurnGenerator(client, recording, rewarder, config.sampling, seed=0, prompt_limit=limit)
    return generator, recording


def request(text: str, **metadata: Any) -> RolloutRequest:
    return RolloutRequest(
        prompt_index=7, messages=[{"role": "user", "content": text}], metadata=metadata, num_samples=3
    )


async def test_a_10_mb_prompt_costs_a_length_check_not_a_tokenization(chat):
    client = RefusingClient()
    generator, recording = make_generator(chat, client)
    started = time.perf_counter()
    group = await generator.generate_group(request("x" * 10_000_000, row=2))
    elapsed = time.perf_counter() - started
    assert recording.rendered == [] and client.requests == 0
    assert [s.mask_reason for s in group.samples] == [PROMPT_TOO_LONG] * 3
    assert all(s.masked and s.prompt_token_ids == [] and s.completion_token_ids == [] for s in group.samples)
    assert elapsed < 30.0, elapsed  # tokenizing it whole took 10-50 s; a length check takes milliseconds


async def test_a_long_prompt_under_the_bound_is_rendered_off_the_event_loop_and_skipped(chat):
    client = RefusingClient()
    generator, recording = make_generator(chat, client)
    # Under the character bound (1024 x the longest token x 4), over 1023 tokens: only tokenizing tells.
    text = "hello " * 8000
    assert len(text) < generator.prompt_limit.max_chars  # type: ignore[union-attr]
    group = await generator.generate_group(request(text))
    assert recording.rendered == [len(text)] and recording.threads[0] != threading.main_thread().name
    assert client.requests == 0 and all(s.mask_reason == PROMPT_TOO_LONG for s in group.samples)


async def test_a_server_that_refuses_the_prompt_as_too_long_skips_it_or_fails_per_on_bad_row(chat):
    client = RefusingClient()
    generator, _ = make_generator(chat, client, on_bad_row="skip")
    group = await generator.generate_group(request("short prompt"))
    assert client.requests >= 1 and all(s.mask_reason == PROMPT_TOO_LONG for s in group.samples)
    generator, _ = make_generator(chat, RefusingClient(), on_bad_row="fail")
    with pytest.raises(
        PromptTooLongError, match="the prompt at data position 7: the inference server refused it"
    ):
        await generator.generate_group(request("short prompt"))


def test_a_jsonl_row_is_named_by_its_line_and_row_in_every_message(tmp_path):
    data = load_config([], [f"output_dir='{tmp_path}'"]).data
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a", "answer": 1}\n\n{oops\n')
    with pytest.raises(ConfigError, match=r"line 3, row 1: not valid JSON"):
        task_from_config(data, path=str(bad_json))
    bad_row = tmp_path / "row.jsonl"
    bad_row.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": 5, "answer": 2}\n')
    with pytest.raises(ConfigError, match=r"line 3, row 1: 'prompt' is missing"):
        task_from_config(data, path=str(bad_row))
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2}\n')
    task = task_from_config(data, path=str(good))
    item = task.items[1]
    assert item.metadata == {"row": 1, "line": 3}
    assert task.describe(item.metadata) == f"data.path = {str(good)!r}, line 3, row 1"


def test_a_prompt_fits_while_it_leaves_room_for_one_token_as_the_engine_rules():
    limit = PromptLimit(16, None)
    assert limit.tokens_problem(15) is None
    assert "more than the 15 that inference.max_model_len = 16 leaves" in limit.tokens_problem(16)
