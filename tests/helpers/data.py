"""Dataset files for tests: rows written as JSONL or parquet, and the quickstart task's prompts as rows."""

from __future__ import annotations

import json
from pathlib import Path

from rollflow.rollout.tasks import CaseTask


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def case_rows(count: int, seed: int = 0) -> list[dict]:
    """The quickstart task's first ``count`` prompts as dataset rows (a plain prompt string and the answer)."""
    task = CaseTask(seed)
    return [
        {"prompt": task.item(i).messages[0]["content"], "answer": task.item(i).answer} for i in range(count)
    ]
