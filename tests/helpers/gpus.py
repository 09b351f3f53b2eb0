"""Marks for GPU tests by how many GPUs they need."""

from __future__ import annotations

import pytest
import torch

# An NCCL group cannot hold two ranks on one GPU (NCCL refuses a duplicate device), so a test whose sender and
# receiver are NCCL ranks in separate processes needs a GPU each; on a one-GPU machine it is skipped saying so.
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="two NCCL ranks, one per GPU (NCCL refuses two ranks on one GPU); this machine has fewer than 2",
)
