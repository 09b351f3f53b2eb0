"""``require_vllm()``: skip a test that needs vLLM, saying why, when vLLM cannot run next to this torch.

Like ``pytest.importorskip("vllm")``, but the reason names the torch build and the import error: vLLM pins
its own torch, so on a machine whose torch it does not fit (the GPU machines' CUDA build, a CPU build) the
import fails, or the package was never installed (``nox -s gpu_tests`` installs it only where it fits). Only
for tests that need vLLM itself; torch-engine GPU tests must not call it.
"""

from __future__ import annotations

import functools
import shutil

import pytest


@functools.cache
def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot be used here, or None when ``import vllm`` works and the ``vllm`` command exists."""
    import torch

    try:
        import vllm  # noqa: F401
    except Exception as error:  # ImportError, or an ABI/version error raised while importing
        return (
            f"vLLM cannot be imported next to torch {torch.__version__} ({type(error).__name__}: {error}); "
            "install it where it fits: pip install 'rollflow[vllm]'"
        )
    if shutil.which("vllm") is None:
        return "vLLM imports, but its `vllm` command is not on PATH"
    return None


def require_vllm() -> None:
    """Skip the calling test (with the reason) unless vLLM is usable here."""
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
