"""Trainer rank 0's half of ``checkpoint``: write the safetensors file, or serve it over HTTP (imports torch)."""

from __future__ import annotations

import http.server
import os
import secrets
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save

from rollflow.errors import WeightTransferError
from rollflow.weights.broadcast import advertised_address

if TYPE_CHECKING:
    from rollflow.weights.checkpoint import CheckpointTransport


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


class CheckpointSession:
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
