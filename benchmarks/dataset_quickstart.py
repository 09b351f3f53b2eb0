"""The quickstart task from a dataset file trains like the built-in task.

Writes the built-in ``case`` task's first ``--rows`` prompts as a JSONL file and as a parquet file (a plain
prompt string and the answer ``upper``/``lower``), then trains ``examples/quickstart.toml`` three times: on
the built-in task (the baseline, in the same run), on the JSONL file and on the parquet file (``data.reward =
"case"``, ``data.epochs`` chosen for the same number of steps). Prints one JSON line per run: the mean reward
of the first 5 and the last 10 steps (the quickstart's bar is <= 0.6 and >= 0.9), wall time, and with
``--eval`` the held-out eval (``[eval]``: 32 prompts of the built-in task under another seed, greedy and 4
samples each) before and after training.

    python benchmarks/dataset_quickstart.py [--steps 200] [--rows 320] [--eval]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from rollflow import Orchestrator, load_config
from rollflow.rollout.tasks import CaseTask

REPO_ROOT = Path(__file__).resolve().parent.parent
EVAL_SEED = 1000
"""The held-out prompts: the built-in task's stream under another seed (the same 32 prompts for every run)."""


def write_files(directory: Path, rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = CaseTask(0)
    table = [
        {"prompt": task.item(i).messages[0]["content"], "answer": task.item(i).answer} for i in range(rows)
    ]
    held_out = CaseTask(EVAL_SEED)
    rows_out = [
        {"prompt": held_out.item(i).messages[0]["content"], "answer": held_out.item(i).answer}
        for i in range(32)
    ]
    (directory / "held_out.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_out))
    jsonl = directory / "case.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in table))
    parquet = directory / "case.parquet"
    pq.write_table(pa.Table.from_pylist(table), parquet)
    return {"jsonl": jsonl, "parquet": parquet}


async def train(name: str, overrides: list[str], with_eval: bool, held_out: Path) -> dict:
    extra = []
    if with_eval:
        extra = ["eval.num_prompts=32", "eval.samples=4", f"eval.seed={EVAL_SEED}"]
        if name != "builtin":
            extra.append(f"eval.path='{held_out}'")
    config = load_config([REPO_ROOT / "examples" / "quickstart.toml"], [*overrides, *extra])
    started = time.perf_counter()
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
        evals = list(orchestrator.eval_history) if with_eval else []
    rewards = [m["reward_mean"] for m in metrics]
    line = {
        "run": name,
        "steps": len(rewards),
        "reward_first5": statistics.fmean(rewards[:5]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "wall_s": time.perf_counter() - started,
    }
    if evals:
        line["eval_before"] = {k: v for k, v in evals[0].items() if k.startswith("eval/")}
        line["eval_after"] = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
    return line


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=320)
    parser.add_argument("--eval", action="store_true", help="also evaluate held-out prompts before and after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.rows)
        epochs = -(-args.steps * 16 // args.rows)  # quickstart: 16 prompts per step
        runs = {
            "builtin": [f"orchestrator.steps={args.steps}"],
            **{
                kind: [f"data.path='{path}'", "data.reward='case'", f"data.epochs={epochs}"]
                for kind, path in files.items()
            },
        }
        for name, overrides in runs.items():
            base = [f"output_dir='{tmp}/runs'", f"name={name}", "checkpoint.every=0"]
            line = await train(name, base + overrides, args.eval, Path(tmp) / "held_out.jsonl")
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    anyio.run(main)
