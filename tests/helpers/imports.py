"""Import-weight checks: what importing modules in a fresh interpreter pulls in of the heavy frameworks."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm", "ray")


def assert_light_imports(modules: str) -> None:
    """``import {modules}`` (comma-separated) in a fresh interpreter imports none of ``HEAVY``."""
    code = f"import sys\nimport {modules}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"`import {modules}` pulled in: {result.stdout.strip()}"
