"""The engine server's half of ``checkpoint``: read the file ``update_info`` names (imports torch)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from rollflow.errors import InvalidTransferInfoError, WeightTransferError, WeightTransferTimeoutError
from rollflow.weights.payloads import CheckpointInit, CheckpointUpdate, decode_update_info


class CheckpointReceiver:
    """Server side of ``checkpoint``: reads the file ``update_info`` names."""

    def __init__(self, init_info: CheckpointInit):
        self.timeout_s = init_info.timeout_s

    def receive(self, update_info: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Load the checkpoint at ``update_info["path"]`` or download ``update_info["url"]``.

        Raises:
            InvalidTransferInfoError: neither ``path`` nor ``url`` is a string.
            WeightTransferError: the file is missing or unreadable, or the download failed.
            WeightTransferTimeoutError: the download took longer than ``timeout_s``.
        """
        update = decode_update_info(update_info, CheckpointUpdate)
        path, url = update.path, update.url
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
