"""Proof of delivery: after a push, every server shows that it serves what the trainer sent.

Two checks, run by a sender after ``/finish_weight_update`` (within the push's ``weight_sync.timeout_s``):

- the version: each server's ``/weight_info`` reports the pushed policy version;
- a digest of a few named tensors: the trainer hashes them as it sends them (``tensor_digests``, on trainer
  rank 0), each server hashes its own copies (vLLM's ``/weight_checker`` checksums: SHA-256 of each parameter's
  bytes), and a server whose tensor differs fails the push, naming the server and the tensor. Only tensors a
  server keeps as the checkpoint has them can be compared, so the names are the one-dimensional ones (norm
  weights: never fused, padded or sharded); a name a server does not report is not compared.
- LoRA adapter pushes (``trainer.lora``: only ``<module>.lora_A.weight`` / ``lora_B.weight`` travel) hash a few
  adapter tensors instead, and every server must report each of them (the torch engine's ``/weight_checker``
  hashes its adapter as received): an adapter that never reached a server fails the push, rather than leaving
  the policy pinned to the base while the run looks merely stale.

``check_delivery`` runs both and records their cost on the sender (``WeightSender.delivery_check_s``, which
the weight barrier reports per step as ``delivery_check_time_s``).

The checks are torch-free; ``tensor_digests`` imports torch inside (it runs where the tensors are).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rollflow.errors import WeightTransferError

if TYPE_CHECKING:
    from rollflow.inference.control import ControlPlane
    from rollflow.weights.base import WeightSender

#: What the wire names of LoRA adapter tensors end with (``rollflow.train.lora``).
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor's wire name."""
    return name.endswith(ADAPTER_SUFFIXES)


def is_adapter_push(digests: dict[str, list[str]]) -> bool:
    """Whether ``digests`` (``tensor_digests``) are of an adapter push, which every engine checks."""
    return any(is_adapter_name(name) for name in digests)


#: Named tensors a push hashes for the digest check.
DIGEST_TENSORS = 4
# A server holds a tensor in its own dtype (the engine casts on load): a digest per dtype it may use.
_DIGEST_DTYPES = ("float32", "bfloat16", "float16")


def tensor_digests(
    named_weights: Iterable[tuple[str, Any]], limit: int = DIGEST_TENSORS
) -> dict[str, list[str]]:
    """SHA-256 of up to ``limit`` one-dimensional floating tensors of ``named_weights`` (spread over the
    model, in name order), one per dtype a server may hold them in: ``{name: [hex, …]}``. For an adapter
    push, of up to ``limit`` adapter tensors instead (see the module docstring)."""
    import torch

    named_weights = list(named_weights)
    if any(is_adapter_name(name) for name, _ in named_weights):
        vectors = sorted((name, tensor) for name, tensor in named_weights if is_adapter_name(name))
    else:
        vectors = sorted(
            (name, tensor)
            for name, tensor in named_weights
            if tensor.ndim == 1 and tensor.is_floating_point()
        )
    if len(vectors) > limit:
        step = (len(vectors) - 1) / max(limit - 1, 1)
        vectors = [vectors[round(i * step)] for i in range(limit)]
    digests = {}
    for name, tensor in vectors:
        cpu = tensor.detach().to("cpu")
        digests[name] = [
            hashlib.sha256(
                cpu.to(getattr(torch, dtype)).contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for dtype in _DIGEST_DTYPES
        ]
    return digests


async def check_served_version(control: ControlPlane, policy_version: int) -> None:
    """Every server's ``/weight_info`` reports ``policy_version``.

    Raises:
        WeightTransferError: naming each server that serves another version, and the one it serves.
    """
    served = await control.weight_versions()
    wrong = {url: version for url, version in served.items() if version != str(policy_version)}
    if wrong:
        listed = "; ".join(f"{url} serves weight_version {version!r}" for url, version in wrong.items())
        raise WeightTransferError(
            f"pushed policy version {policy_version}, but after /finish_weight_update {listed}; the update "
            "did not take on those servers (see their logs)"
        )


async def check_served_digests(
    control: ControlPlane, digests: dict[str, list[str]], policy_version: int
) -> None:
    """Every server holds the tensors ``digests`` names (from ``tensor_digests``) as the trainer sent them.

    Raises:
        WeightTransferError: naming each server and tensor that differ.
    """
    if not digests:
        return
    served = await control.weight_checksums()
    wrong = [
        f"{url} holds {name} with another digest"
        for url, checksums in served.items()
        for name, expected in digests.items()
        if name in checksums and not checksums[name] <= set(expected)
    ]
    # An adapter tensor a server does not report never reached it.
    wrong += [
        f"{url} holds no {name} (the adapter did not reach it)"
        for url, checksums in served.items()
        for name in digests
        if is_adapter_name(name) and name not in checksums
    ]
    if wrong:
        raise WeightTransferError(
            f"pushed policy version {policy_version}, but {'; '.join(wrong)} than the trainer sent: the "
            "server does not serve the pushed weights"
        )


async def check_delivery(
    sender: WeightSender, control: ControlPlane, digests: dict[str, list[str]], policy_version: int
) -> None:
    """Both checks (the served version, then the digests), their time recorded as
    ``sender.delivery_check_s``.

    Raises:
        WeightTransferError: as ``check_served_version`` and ``check_served_digests``.
    """
    started = time.perf_counter()
    sender.delivery_check_s = None
    await check_served_version(control, policy_version)
    await check_served_digests(control, digests, policy_version)
    sender.delivery_check_s = time.perf_counter() - started
