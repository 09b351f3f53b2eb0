"""Benchmarks run from a plain checkout: they never import ``tests/`` (what they share is in the package)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_no_benchmark_imports_the_tests():
    offenders = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{script.name}: {name}" for name in names if name.split(".")[0] == "tests"]
    assert list(BENCHMARKS.glob("*.py")) and offenders == []
