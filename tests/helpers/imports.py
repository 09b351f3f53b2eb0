"""Import-weight checks: what importing modules in a fresh interpreter pulls in of the heavy frameworks; and
``needs``, a skip mark for an optional package that does not import it at collection."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm", "ray")


def assert_light_imports(modules: str) -> None:
    """``import {modules}`` (comma-separated) in a fresh interpreter imports none of ``HEAVY``."""
    code = f"import sys\nimport {modules}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"`import {modules}` pulled in: {result.stdout.strip()}"


def needs(module: str, install: str) -> pytest.MarkDecorator:
    """Skip unless ``module`` is installed, found without importing it: ``pytest.importorskip`` at a test
    module's top imports the package in every xdist worker at collection, in every pass, whether or not the
    worker runs the module (``openenv.core`` alone takes ~6 s, gradio included). The tests import it
    themselves."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        found = False
    return pytest.mark.skipif(not found, reason=f"needs {install}")
