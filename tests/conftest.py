"""Shared fixtures. Tests never touch the network: the tiny model is built locally."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A shell that starts a job in the background (CI runners do) makes it ignore SIGINT, and children inherit
# that; the Ctrl-C tests send SIGINT to subprocesses, so give this process (and thereby them) the default.
signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollflow.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_moe_model_dir() -> Path:
    from rollflow.models.tiny import ensure_tiny_moe_model

    return ensure_tiny_moe_model()


@pytest.fixture(scope="session")
def inference_servers(tmp_path_factory):
    """Two real ``rollflow serve`` servers shared by the HTTP tests (see ``tests/inference_servers.py``).

    Tests must leave them running and unpaused; a test that kills a server starts its own.
    """
    from .inference_servers import BackgroundServerGroup

    servers = BackgroundServerGroup(2, tmp_path_factory.mktemp("inference-servers"))
    yield servers
    servers.close()
