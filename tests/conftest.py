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


@pytest.fixture(scope="module")
def uncached_engine(tiny_model_dir):
    """A tiny-model torch engine without a prefix cache, for one test module.

    A prompt seen before would be extended rather than prefilled, which changes logprobs in the last bits and
    would make "streamed == non-streamed" comparisons depend on the order of calls.
    """
    import asyncio

    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm

    engine = TorchEngine(
        load_causal_lm(tiny_model_dir), max_batch_size=4, max_model_len=1024, enable_prefix_caching=False
    )
    yield engine
    asyncio.run(engine.shutdown())


from .ray_cluster_fixture import ray_cluster  # noqa: E402, F401  (the session's one Ray cluster)
