"""``checkpoint``: weights travel as one safetensors file, for trainer and engines without a common process group.

Two transports:
- ``checkpoint_dir`` set: the sender writes ``<dir>/policy-<version>.safetensors`` (to a temporary name, then
  renamed, so a reader never sees half a file) and ``update_info["path"]`` names it. The directory must be
  visible to every server (same machine, or a shared filesystem).
- ``checkpoint_dir`` unset: the sender serves the file's bytes from a small HTTP endpoint in the trainer
  process and ``update_info["url"]`` names it (with an unguessable token); each server fetches it. Pulling
  rather than posting keeps the bytes out of ``/update_weights`` bodies (and their size limits).

Only the newest checkpoint is kept: the previous one is deleted once a push of the next one succeeded.
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
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save

from rollflow.weights.base import (
    InvalidTransferInfoError,
    WeightSender,
    WeightTransferError,
    WeightTransferStrategy,
    WeightTransferTimeoutError,
)

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
    """

    name = "checkpoint"

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ):
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be positive, got {timeout_s}")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.host = host
        self.timeout_s = timeout_s

    def create_init_info(self, inference_world_size: int) -> dict[str, Any]:
        # Every server reads the same file, so the number of workers does not change the payload.
        return {"backend": "checkpoint", "timeout_s": self.timeout_s}

    def create_sender(self, init_info: dict[str, Any]) -> CheckpointSender:
        return CheckpointSender(init_info, checkpoint_dir=self.checkpoint_dir, host=self.host)


class CheckpointSender(WeightSender):
    """Trainer side of ``checkpoint``."""

    def __init__(self, init_info: dict[str, Any], *, checkpoint_dir: Path | None, host: str):
        super().__init__(init_info)
        self.timeout_s = float(init_info["timeout_s"])
        self.checkpoint_dir = checkpoint_dir
        self.host = host
        self._blob = _Blob()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._previous: Path | str | None = None

    async def setup(self, client: Any) -> None:
        if self.checkpoint_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        else:
            handler = type("_BlobHandler", (_Handler,), {"blob": self._blob})
            self._server = http.server.ThreadingHTTPServer((self.host, 0), handler)
            self._server.daemon_threads = True
            threading.Thread(
                target=self._server.serve_forever, name="rollflow-weights-http", daemon=True
            ).start()
        with anyio.fail_after(self.timeout_s):
            await client.init_weight_update_communicator(self.init_info)

    async def push(self, client: Any, named_weights: Iterable[tuple[str, Any]], policy_version: int) -> None:
        named = list(named_weights)
        try:
            with anyio.fail_after(self.timeout_s):
                data = await anyio.to_thread.run_sync(serialize, named)
                location = await anyio.to_thread.run_sync(self._publish, data, policy_version)
                await client.start_weight_update()
                await client.update_named_weights({**location, "policy_version": policy_version})
                await client.finish_weight_update(weight_version=policy_version)
        except TimeoutError as exc:
            raise WeightTransferTimeoutError(
                f"pushing policy version {policy_version} as a checkpoint took longer than {self.timeout_s:g} s"
            ) from exc
        self._retire_previous(location)

    def _publish(self, data: bytes, policy_version: int) -> dict[str, str]:
        filename = f"policy-{policy_version:08d}.safetensors"
        if self.checkpoint_dir is not None:
            fd, staging = tempfile.mkstemp(prefix=".staging-", dir=self.checkpoint_dir)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            path = self.checkpoint_dir / filename
            os.replace(staging, path)
            return {"path": str(path.resolve())}
        if self._server is None:
            raise WeightTransferError("call setup(client) before push")
        key = f"{secrets.token_urlsafe(16)}/{filename}"
        with self._blob.lock:
            self._blob.files[key] = data
        host, port = self._server.server_address[:2]
        return {"url": f"http://{host}:{port}/{key}"}

    def _retire_previous(self, location: dict[str, str]) -> None:
        previous, self._previous = self._previous, location.get("path") or location["url"].rsplit("/", 2)[-2]
        if previous is None or previous == self._previous:
            return
        if self.checkpoint_dir is not None:
            Path(previous).unlink(missing_ok=True)
        else:
            with self._blob.lock:
                for key in [k for k in self._blob.files if k.startswith(f"{previous}/")]:
                    del self._blob.files[key]

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
