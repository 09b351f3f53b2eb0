"""Small orchestrator runs on the tiny model: their config, and the JSONL files they write."""

from __future__ import annotations

import json
from pathlib import Path

from rollflow import load_config

SMALL = [
    "orchestrator.prompts_per_step=4",
    "sampling.samples_per_prompt=4",
    "sampling.max_tokens=4",
    "data.task='digit'",
    # A free port, not the default 8080: runs in http mode start a router, and tests run side by side.
    "inference.router_port=0",
]


def small_config(tmp_path: Path, *overrides: str):
    return load_config([], [f"output_dir='{tmp_path / 'runs'}'", "name=t", *SMALL, *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
