"""Metric files and the progress display."""

from __future__ import annotations

import io
import json

from rollflow.metrics import JsonlWriter, ProgressDisplay, truncate_jsonl_after_step


def test_jsonl_writer_flushes_every_line(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.log({"step": 1, "loss": float("nan")})
    # Readable before close: a killed run keeps every finished line.
    assert json.loads(path.read_text().splitlines()[0])["step"] == 1
    writer.close()


def test_truncate_drops_redone_steps_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert truncate_jsonl_after_step(path, 4) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert truncate_jsonl_after_step(tmp_path / "absent.jsonl", 4) == 0


def metrics(step: int) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "tokens_per_s": 1234.0, "loss": 0.5, "step_time_s": 0.1}


def test_plain_progress_prints_one_line_per_step():
    stream = io.StringIO()
    display = ProgressDisplay(4, stream=stream, interactive=False)
    for step in (1, 2):
        display.log(metrics(step))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("step 2/4") and "reward 0.500" in lines[1] and "1,234 tok/s" in lines[1]
    assert "ETA" in lines[1] and "\r" not in stream.getvalue()


def test_terminal_progress_redraws_one_line():
    stream = io.StringIO()
    display = ProgressDisplay(3, stream=stream, interactive=True)
    display.log(metrics(1))
    display.log(metrics(2))
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") >= 2  # redrawn in place
    last = text.split("\r")[-1]
    assert last.startswith("step 2/3") and "reward 0.500" in last and "1,234 tok/s" in last
    display.log(metrics(3))
    assert stream.getvalue().endswith("\n")  # the finished bar stays


def test_terminal_progress_of_a_resumed_run_starts_at_its_step():
    stream = io.StringIO()
    display = ProgressDisplay(10, stream=stream, interactive=True)
    display.log(metrics(7))
    assert stream.getvalue().split("\r")[-1].startswith("step 7/10")
    display.close()
