"""The light core must not import heavy frameworks at module scope (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .helpers.imports import assert_light_imports

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.mark.parametrize(
    "modules",
    [
        "rollflow, rollflow.config",
        "rollflow.messages, rollflow.channels, rollflow.errors",
        "rollflow.inference.client, rollflow.inference.control, rollflow.inference.remote",
        "rollflow.http, rollflow.http.front, rollflow.http.upstream, rollflow.http.runner, rollflow.http.sse",
        "rollflow.weights, rollflow.weights.registry, rollflow.weights.ranks, rollflow.weights.rounds",
        "rollflow.weights.payloads, rollflow.weights.server.state, rollflow.weights.server.receiver",
        "rollflow.weights.local, rollflow.weights.base, rollflow.weights.broadcast",
        "rollflow.weights.checkpoint, rollflow.weights.cuda_ipc, rollflow.weights.vllm_nccl",
        "rollflow.orchestrator, rollflow.cli",
        "rollflow.launch.plan, rollflow.launch.ray_cluster, rollflow.launch.launcher",
        "rollflow.launch.ray_launcher, rollflow.launch.ray_trainer, rollflow.launch.ray_servers",
    ],
)
def test_light_imports(modules):
    assert_light_imports(modules)


def test_lazy_public_api_resolves():
    import rollflow

    assert rollflow.Orchestrator.__name__ == "Orchestrator"
    assert callable(rollflow.load_config)
    with pytest.raises(AttributeError):
        rollflow.NoSuchThing  # noqa: B018


# Components never import the orchestrator; it wires them (DESIGN.md, "Dependencies point one way").
COMPONENTS = ("rollout", "tito", "train", "inference", "weights")


def _orchestrator_imports(path) -> list[str]:
    """``file:line`` of each import of ``rollflow.orchestrator`` in ``path``, at any depth (inside functions
    too), relative ones resolved against the file's package."""
    import ast

    package = path.relative_to(SRC).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from ..orchestrator import x
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(
            name == "rollflow.orchestrator" or name.startswith("rollflow.orchestrator.") for name in names
        ):
            found.append((node.lineno, f"{path.relative_to(SRC)}:{node.lineno}"))
    return [where for _, where in sorted(found)]


def test_components_never_import_the_orchestrator():
    files = [
        path for component in COMPONENTS for path in sorted((SRC / "rollflow" / component).rglob("*.py"))
    ]
    assert len(files) > 20  # the walk found the packages
    offenders = [where for path in files for where in _orchestrator_imports(path)]
    assert offenders == [], f"components import rollflow.orchestrator: {offenders}"


def test_the_import_check_sees_nested_and_relative_imports(tmp_path, monkeypatch):
    module = tmp_path / "rollflow" / "rollout" / "sneaky.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def f():\n    from rollflow.orchestrator.barrier import WeightBarrier\n"
        "from ..orchestrator import builders\nimport rollflow.orchestrator as o\nimport rollflow.config\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _orchestrator_imports(module) == [
        "rollflow/rollout/sneaky.py:2",
        "rollflow/rollout/sneaky.py:3",
        "rollflow/rollout/sneaky.py:4",
    ]


def test_building_every_sender_imports_no_torch():
    """The orchestrator builds strategies and senders (``BroadcastStrategy(backend=None)`` included: the
    default backend is picked on trainer rank 0) without torch."""
    code = (
        "import sys\n"
        "from rollflow.weights import create_strategy\n"
        "for name in ('broadcast', 'checkpoint', 'cuda_ipc'):\n"
        "    create_strategy(name).create_sender(2)\n"
        "create_strategy('broadcast', engine='vllm').create_sender(2)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
