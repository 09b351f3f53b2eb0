"""``checkpoint``: weights travel as one safetensors file, for trainer and engines without a common process group.

Two transports:
- ``checkpoint_dir`` set: the sender writes ``<dir>/policy-<version>.safetensors`` (to a temporary name, then
  renamed, so a reader never sees half a file) and ``update_info["path"]`` names it. The directory must be
  visible to every server (same machine, or a shared filesystem).
- ``checkpoint_dir`` unset: the sender serves the file's bytes from a small HTTP endpoint in the trainer
  process and ``update_info["url"]`` names it (with an unguessable token); each server fetches it. Pulling
  rather than posting keeps the bytes out of ``/update_weights`` bodies (and their size limits).

The trainer side (``CheckpointTransport``, rank 0) writes or serves the file and reports where; the control half
(``CheckpointSender``) then has the servers read it. Only the newest file is kept: each push retires the files
of earlier ones (each push ends, the servers having loaded its file, before the next begins).

vLLM servers (``engine="vllm"``) read the file through rollflow's plugin engine (``rollflow.vllm_plugin``,
selected by ``--weight-transfer-config '{"backend": "rollflow_checkpoint"}'``), whose payloads declare only
``timeout_s`` (init) and ``path`` / ``url`` / ``policy_version`` (update). After each push to them the sender
checks delivery (``rollflow.weights.delivery``): every server serves the pushed version, and a few named
tensors with the digests rank 0 computed as it wrote the file (checked on vLLM 0.32.0).
"""

from __future__ import annotations

import http.server
import os
import secrets
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save

from rollflow.errors import InvalidTransferInfoError, WeightTransferError, WeightTransferTimeoutError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
    new_transfer_id,
)
from rollflow.weights.delivery import check_served_digests, check_served_version, tensor_digests
from rollflow.weights.rounds import init_servers, open_transport

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)


def serialize(named_weights: Iterable[tuple[str, Any]]) -> bytes:
    """safetensors bytes of ``named_weights`` (moved to CPU). Tensors sharing memory (tied embeddings) are
    cloned, since safetensors refuses shared storage."""
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, value in named_weights:
        tensor = torch.as_tensor(value).detach().to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        seen.add(key)
        tensors[name] = tensor
    return save(tensors)


class _Blob:
    """The bytes currently served, by token; replaced on every push."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, bytes] = {}


class _Handler(http.server.BaseHTTPRequestHandler):
    blob: _Blob  # set on a per-server subclass
    # Socket timeout (s): a client silent this long in its request, or not reading the reply, is dropped
    # (each connection holds a thread; without it a stalled one would hold it for good).
    timeout = 30.0

    def do_GET(self) -> None:
        with self.blob.lock:
            data = self.blob.files.get(self.path.lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the stdlib logs every GET to stderr
        pass


class CheckpointStrategy(WeightTransferStrategy):
    """One safetensors file per policy version, through a shared directory or the trainer's HTTP endpoint.

    Args:
        checkpoint_dir: a directory every server can read; None serves the file over HTTP instead.
        host: address the HTTP endpoint binds and advertises (when ``checkpoint_dir`` is None).
        timeout_s: longest one push, or one server's read, may take.
        dtype: what floating weights are cast to before they are written (``weight_sync.dtype``).
        engine: the servers' kind: ``"torch"`` (``rollflow serve``) or ``"vllm"`` (the plugin engine's payloads,
            and a check of the served version and tensor digests after each push).
    """

    name = "checkpoint"

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        dtype: str = "auto",
        engine: str = "torch",
    ):
        if engine not in ("torch", "vllm"):
            raise ValueError(f"checkpoint engine must be 'torch' or 'vllm', got {engine!r}")
        self.engine = engine
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be positive, got {timeout_s}")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.host = host
        self.timeout_s = timeout_s
        self.dtype = check_transfer_dtype(dtype)

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        return dict(
            checkpoint_dir=sync.checkpoint_dir,
            host=master_address,
            timeout_s=sync.timeout_s,
            dtype=sync.dtype,
            engine=engine,
        )

    def create_sender(self, inference_world_size: int) -> CheckpointSender:
        # Every server reads the same file, so the number of workers does not change the payload.
        return CheckpointSender(inference_world_size, self)


class CheckpointSender(WeightSender):
    """Control half of ``checkpoint``: the trainer writes (or serves) the file, then the servers read it."""

    label = "checkpoint"
    how = "as a checkpoint"

    def __init__(self, inference_world_size: int, strategy: CheckpointStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.engine = strategy.engine
        self.transfer_id = new_transfer_id()
        directory = strategy.checkpoint_dir
        self.transport = CheckpointTransport(
            transfer_id=self.transfer_id,
            checkpoint_dir=None if directory is None else str(directory.resolve()),
            host=strategy.host,
            timeout_s=strategy.timeout_s,
            dtype=strategy.dtype,
            digests=self.engine == "vllm",
        )

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        await open_transport(
            self, source, TransportCall(self.transport, "open", {"release": list(release)}), self.timeout_s
        )
        self.init_info = {"timeout_s": self.timeout_s}
        if self.engine == "torch":  # vLLM picks its engine from --weight-transfer-config, and refuses the key
            self.init_info["backend"] = "checkpoint"
        await init_servers(self, control, "checkpoint", self.timeout_s)

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        location = dict(
            await source.run(TransportCall(self.transport, "push", {"policy_version": policy_version}))
        )
        digests = location.pop("digests", {})
        await control.start_weight_update()
        await control.update_weights({**location, "policy_version": policy_version})
        await control.finish_weight_update(policy_version)
        if self.engine == "vllm":
            await check_served_version(control, policy_version)
            await check_served_digests(control, digests, policy_version)


@dataclass(frozen=True)
class CheckpointTransport:
    """Transport half of ``checkpoint`` (picklable): every rank iterates and gathers; rank 0 writes the file
    (or serves it from an HTTP endpoint in its own process) and reports where it is."""

    transfer_id: str
    checkpoint_dir: str | None
    host: str
    timeout_s: float
    dtype: str = "auto"
    # Rank 0 also reports digests of a few named tensors (``rollflow.weights.delivery``), for vLLM servers.
    digests: bool = False

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> None:
        from rollflow.weights.trainer.sessions import open_session, release_sessions

        release_sessions(release)
        if rank == 0:
            open_session(self.transfer_id, rank, lambda: _CheckpointSession(self))

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> Any:
        """Rank 0 returns ``{"path": …}`` or ``{"url": …}`` (with ``"digests"`` when asked), and retires the
        files of earlier pushes (the servers have loaded them: each push ends before the next starts)."""
        from rollflow.weights.trainer.sessions import full_weights, get_session, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != 0:
            for _ in weights:
                pass
            return None
        session = get_session(self.transfer_id, rank)
        if not self.digests:
            return session.publish(serialize(weights), policy_version)
        weights = list(weights)  # the same tensors serialize holds at once anyway
        return {**session.publish(serialize(weights), policy_version), "digests": tensor_digests(weights)}

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        from rollflow.weights.trainer.sessions import release_sessions

        release_sessions([self.transfer_id])


class _CheckpointSession:
    """Rank 0's files (or HTTP endpoint) of one connection."""

    def __init__(self, transport: CheckpointTransport):
        self.directory = Path(transport.checkpoint_dir) if transport.checkpoint_dir is not None else None
        self._blob = _Blob()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._published: list[str] = []  # paths, or URL keys
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        else:
            handler = type("_BlobHandler", (_Handler,), {"blob": self._blob})
            self._server = http.server.ThreadingHTTPServer((transport.host, 0), handler)
            self._server.daemon_threads = True
            threading.Thread(
                target=self._server.serve_forever, name="rollflow-weights-http", daemon=True
            ).start()

    def publish(self, data: bytes, policy_version: int) -> dict[str, str]:
        filename = f"policy-{policy_version:08d}.safetensors"
        if self.directory is not None:
            fd, staging = tempfile.mkstemp(prefix=".staging-", dir=self.directory)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            path = self.directory / filename
            os.replace(staging, path)
            self._retire(keep=str(path))
            return {"path": str(path)}
        if self._server is None:
            raise WeightTransferError("this checkpoint transport was closed")
        key = f"{secrets.token_urlsafe(16)}/{filename}"
        with self._blob.lock:
            self._blob.files[key] = data
        self._retire(keep=key)
        from rollflow.weights.broadcast import advertised_address

        host, port = self._server.server_address[:2]
        return {"url": f"http://{advertised_address(host)}:{port}/{key}"}

    def _retire(self, keep: str) -> None:
        retired = [name for name in self._published if name != keep]
        self._published = [keep]
        for name in retired:
            if self.directory is not None:
                Path(name).unlink(missing_ok=True)
            else:
                with self._blob.lock:
                    self._blob.files.pop(name, None)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._blob.lock:
            self._blob.files.clear()


class CheckpointReceiver:
    """Server side of ``checkpoint``: reads the file ``update_info`` names."""

    def __init__(self, init_info: dict[str, Any]):
        try:
            self.timeout_s = float(init_info.get("timeout_s", 300.0))
        except (TypeError, ValueError):
            raise InvalidTransferInfoError(
                f"init_info.timeout_s must be a number, got {init_info['timeout_s']!r}"
            ) from None

    def receive(self, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Load the checkpoint at ``update_info["path"]`` or download ``update_info["url"]``.

        Raises:
            InvalidTransferInfoError: neither ``path`` nor ``url`` is a string.
            WeightTransferError: the file is missing or unreadable, or the download failed.
            WeightTransferTimeoutError: the download took longer than ``timeout_s``.
        """
        path, url = update_info.get("path"), update_info.get("url")
        if isinstance(path, str):
            if not os.path.isfile(path):
                raise WeightTransferError(
                    f"checkpoint {path} does not exist on this server: weight_sync.checkpoint_dir must be a "
                    "directory shared by the trainer and every server (or leave it unset to transfer over HTTP)"
                )
            try:
                return list(load_file(path).items())
            except Exception as exc:
                raise WeightTransferError(f"cannot read checkpoint {path}: {exc}") from exc
        if isinstance(url, str):
            if not url.startswith(("http://", "https://")):
                raise InvalidTransferInfoError(f"update_info.url must be an http(s) URL, got {url!r}")
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                    data = response.read()
            except TimeoutError as exc:
                raise WeightTransferTimeoutError(f"downloading weights from {url} timed out: {exc}") from exc
            except (urllib.error.URLError, OSError) as exc:
                raise WeightTransferError(f"downloading weights from {url} failed: {exc}") from exc
            try:
                return list(load_safetensors(data).items())
            except Exception as exc:
                raise WeightTransferError(
                    f"weights downloaded from {url} are not valid safetensors: {exc}"
                ) from exc
        raise InvalidTransferInfoError("a checkpoint update_info needs a string 'path' or 'url'")

    def close(self) -> None:
        """Nothing to release."""
