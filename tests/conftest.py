"""Shared fixtures. Tests never touch the network: the tiny model is built locally."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
import structlog

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A shell that starts a job in the background (CI runners do) makes it ignore SIGINT, and children inherit
# that; the Ctrl-C tests send SIGINT to subprocesses, so give this process (and thereby them) the default.
signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per test process, and for the runs and servers it starts. pytest-xdist's two workers on a
# 2-core machine, each test with torch's default of 2 threads, oversubscribe the cores, and OpenMP's spinning
# threads then slow the tiny model's small ops manyfold: two 60-step quickstarts side by side took 88 s with 2
# threads each and 13 s with 1 (alone: 14 s vs 13 s). A test that needs another count sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh_structlog(monkeypatch):
    """Each test starts from structlog's defaults, and a CLI command run inside a test does not cache its
    loggers: a cached logger keeps the CLI's configuration and bypasses the one ``capture_logs`` sets."""
    import rollflow.cli

    monkeypatch.setattr(
        rollflow.cli, "configure_logging", functools.partial(rollflow.cli.configure_logging, cache=False)
    )
    yield
    structlog.reset_defaults()


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
    """Two real ``rollflow serve`` servers shared by the HTTP tests (see ``tests/helpers/servers.py``).

    Tests must leave them running and unpaused; a test that kills a server starts its own.
    """
    from .helpers.servers import BackgroundServerGroup

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


from .helpers.ray_cluster import ray_cluster  # noqa: E402, F401  (the session's one Ray cluster)
from .helpers.tito import tiny_chat  # noqa: E402, F401  (the tiny model's tokenizer and renderer)

# ---------------------------------------------------------------- the inference client under test

ONE_MODE_MARKERS = ("local_only", "http_only")
CLIENT_FIXTURES = frozenset({"inference_client", "inference_backend"})
_KIND_PROPERTY = "inference_kind"


def pytest_configure(config):
    from .helpers.clients import suite_inference_mode

    suite_inference_mode()  # a bad $ROLLFLOW_INFERENCE_MODE is a usage error before anything runs


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real vLLM server for the ``vllm`` tests of the session (``tests/helpers/vllm_server.py``). Tests
    leave it unpaused; weights they push stay (each test pushes the weights it checks against)."""
    from .helpers.vllm_server import VllmServer

    server = VllmServer(tmp_path_factory.mktemp("vllm-server"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def inference_backend(request, tmp_path_factory):
    """The engines behind ``inference_client``, shared by the session (see ``tests/helpers/clients.py``):
    read-only by contract, so a test that moves weights starts its own."""
    from .helpers.clients import HttpBackend, LocalBackend, suite_inference_mode

    if suite_inference_mode() == "local":
        backend = LocalBackend(request.getfixturevalue("tiny_model_dir"))
    else:
        backend = HttpBackend(request.getfixturevalue("inference_servers"), tmp_path_factory.mktemp("router"))
    yield backend
    backend.close()


@pytest.fixture
async def inference_client(inference_backend):
    """An ``InferenceClient`` of the tiny model in the suite's mode (``$ROLLFLOW_INFERENCE_MODE``). Tests
    taking it are marked ``follows_mode``. After the test, the shared engines must be unpaused and on their
    initial weights, or the test fails. Its event loop is the test's own (function-scoped), so modules that
    run their tests on a module-scoped loop cannot take it."""
    client = inference_backend.client()
    try:
        yield client
    finally:
        if inference_backend.mode == "http":
            await client.close()  # a local client's close would shut the shared engine down
    problem = await inference_backend.check_untouched()
    if problem:
        pytest.fail(f"the test {problem}: shared engines are read-only; start private ones to change them")


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config, items):
    """Mark every test that takes ``inference_client`` as ``follows_mode``; check the one-mode markers (the
    closest wins, so a module marked ``http_only`` can hold a ``local_only`` test) and record each test's
    kind for the summary; skip the ``vllm`` tests (saying why) where no vLLM environment is given."""
    from .helpers.vllm_server import SKIP_REASON, vllm_available

    for item in items:
        if item.get_closest_marker("vllm") and not vllm_available():
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
        one_mode = next((m for m in item.iter_markers() if m.name in ONE_MODE_MARKERS), None)
        if one_mode is not None and not one_mode.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{one_mode.name} needs reason='why'")
        follows = bool(CLIENT_FIXTURES & set(item.fixturenames)) or item.get_closest_marker("follows_mode")
        if follows and one_mode is not None:
            raise pytest.UsageError(
                f"{item.nodeid} follows the suite's inference mode (inference_client or follows_mode) but is "
                f"marked {one_mode.name}: drop one, or build the one client it is about"
            )
        kind = "follows_mode" if follows else one_mode.name if one_mode is not None else None
        if follows:
            item.add_marker(pytest.mark.follows_mode)
        if kind is not None:
            # In the report too: with pytest-xdist the summary is written where nothing was collected.
            item.user_properties.append((_KIND_PROPERTY, kind))


def pytest_terminal_summary(terminalreporter, config):
    """How many tests that drive inference ran, by kind, and the mode the mode-following ones ran in."""
    from .helpers.clients import suite_inference_mode

    ran = {"follows_mode": 0, "local_only": 0, "http_only": 0}
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        kind = dict(getattr(report, "user_properties", ())).get(_KIND_PROPERTY)
        if report.when == "call" and kind is not None:
            ran[kind] += 1
    terminalreporter.write_line(
        f"inference tests run: {ran['follows_mode']} mode-following (in {suite_inference_mode()} mode), "
        f"{ran['local_only']} local-only, {ran['http_only']} http-only"
    )
