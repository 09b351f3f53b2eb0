"""The light core must not import heavy frameworks at module scope (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm", "ray")


@pytest.mark.parametrize(
    "modules",
    [
        "rollflow, rollflow.config",
        "rollflow.messages, rollflow.channels, rollflow.errors",
        "rollflow.inference.client",
        "rollflow.orchestrator, rollflow.cli",
        "rollflow.launch.plan, rollflow.launch.ray_cluster, rollflow.launch.launcher",
        "rollflow.launch.ray_launcher, rollflow.launch.ray_trainer, rollflow.launch.ray_servers",
    ],
)
def test_light_imports(modules):
    code = f"import sys\nimport {modules}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"`import {modules}` pulled in: {result.stdout.strip()}"


def test_lazy_public_api_resolves():
    import rollflow

    assert rollflow.Orchestrator.__name__ == "Orchestrator"
    assert callable(rollflow.load_config)
    with pytest.raises(AttributeError):
        rollflow.NoSuchThing  # noqa: B018
