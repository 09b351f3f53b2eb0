"""Write GSM8K-format data as rollflow JSONL: ``{OUTPUT}/train.jsonl`` and ``{OUTPUT}/test.jsonl``.

Each input row has ``question`` and ``answer`` (a worked solution ending in ``#### N``, GSM8K's format). Each
output row has ``prompt`` (chat messages: a system instruction to put the final answer in ``\\boxed{}`` and
the question) and ``answer`` (``N``, commas removed), which ``data.reward = "math"`` compares with.

    python examples/math/prepare_gsm8k.py --output data/gsm8k                       # HF cache: openai/gsm8k
    python examples/math/prepare_gsm8k.py --input train.jsonl [--test-input test.jsonl] --output data/gsm8k

Prints one JSON line: the rows written per split and the rows skipped (no ``####`` answer).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

SYSTEM = "Solve the problem step by step. Put the final answer, a number only, in \\boxed{}."


def convert(row: dict) -> dict | None:
    """One GSM8K row as a rollflow row; None when its answer has no ``####`` final answer."""
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str) or "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        return None
    return {
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question.strip()}],
        "answer": final,
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_hf_cache(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        sys.exit("reading the HF cache needs the datasets library: pip install datasets (or pass --input)")
    return datasets.load_dataset(name, "main", split=split).to_list()


def write(rows: Iterable[dict], path: Path) -> tuple[int, int]:
    written = skipped = 0
    with path.open("w") as out:
        for row in rows:
            converted = convert(row)
            if converted is None:
                skipped += 1
                continue
            out.write(json.dumps(converted) + "\n")
            written += 1
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument(
        "--input", type=Path, help="GSM8K-format JSONL for the train split (default: HF cache)"
    )
    parser.add_argument("--test-input", type=Path, help="GSM8K-format JSONL for the test split")
    parser.add_argument("--hf-name", default="openai/gsm8k", help="dataset in the local HF cache")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    sources = {}
    if args.input is None:
        sources = {split: read_hf_cache(args.hf_name, split) for split in ("train", "test")}
    else:
        sources["train"] = read_jsonl(args.input)
        if args.test_input is not None:
            sources["test"] = read_jsonl(args.test_input)
    summary = {}
    for split, rows in sources.items():
        written, skipped = write(rows, args.output / f"{split}.jsonl")
        summary[split] = {"written": written, "skipped": skipped}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
