"""``rollflow serve``: an aiohttp server over one ``TorchEngine`` that speaks the RL subset of vLLM 0.33's HTTP API.

The same ``RemoteInferenceClient`` and router drive vLLM on GPUs and this server on CPUs, so paths, field names,
status codes and the error JSON follow vLLM (``shared/reference/vllm-http-api.md``). This module holds the
server's state, the middlewares and the weight-transfer endpoints; the data plane is in ``server_routes``,
health, metrics and engine control (pause, sleep, aborts) in ``server_admin``, the process entry point in
``server_main``. Where it departs from vLLM:

- One worker: ``/get_world_size`` is 1.
- ``/sleep?level=1`` frees the KV cache and prefix cache and keeps the weights (on a GPU in CPU memory, as
  vLLM; on a CPU where they are); ``level=2`` frees the weights too, and ``/wake_up?tags=weights`` brings them
  back zeroed for the weight push to fill (``/update_weights`` before that is a 409). ``mode=keep`` is refused
  for levels 1 and 2 (frozen requests would lose their KV cache). As in vLLM, scheduling resumes once weights
  and KV cache are both awake. Every control call (sleep, wake_up, pause, resume, weight updates) is recorded
  in order, with the requests finished and tokens generated so far, at ``GET /control_log`` (``?clear=true`` empties it).
- Token logprobs are the sampled token's only: a top-k count above 0 (``logprobs``, ``top_logprobs``) is a 400.
  Stop strings, ``min_p``, ``min_tokens``, penalties, ``logit_bias`` and prompt logprobs are 400s naming the
  field; so is ``stream`` on ``/inference/v1/generate`` (streaming is served on ``/v1/completions`` and
  ``/v1/chat/completions``).
- A dead engine (its loop died) answers 503 with error ``type`` ``EngineDeadError``, ``/health`` included, where
  a pause answers ``ServiceUnavailableError``; vLLM answers 500 and exits. Weights holding inf or NaN, or values
  that overflow to inf when cast to the engine's dtype (float64 1e300 for a float32 model), are a 400 naming
  the tensors, and the weights in use stay.
- Every choice also carries ``policy_versions``: the policy version that sampled each token, and, when top-k or
  top-p cut a token's vocabulary, ``kept_counts``: per token, how many of the most likely tokens the sampler
  kept (``GenerateOutput.kept_counts``, one int a token). Logprobs are vLLM's ``processed_logprobs`` (after
  temperature, over the kept set); ``--logprobs-mode raw_logprobs`` serves vLLM's default instead, to
  emulate a vLLM started without the flag.
- ``/pause?mode=wait`` returns once running requests finished; requests still queued behind a full batch start
  after ``/resume`` (vLLM drains those too).

Every malformed request gets a 4xx with ``{"error": {"message", "type", "param", "code"}}``, including those
aiohttp rejects before routing (a bad ``Content-Length``): the server's request handler writes that JSON too.
Run the app with ``handler_cancellation=True`` (``EngineServer.start`` does) so that a client that disconnects
cancels its handler, which aborts its engine request. Clients that stall in a request's line, headers or
body get a 408 and are disconnected, and connections beyond a cap get a 503 (``HttpLimits``, enforced by
``rollflow.http.runner``); bodies over ``max_body_bytes`` get a 413. A generation request asking for more
sequences (prompts x ``n``) or tokens than ``request_limits`` allow is a 400 before any of it is done (``--max-request-sequences``,
``--max-request-tokens``), and the engine shares its batch fairly between the requests it accepted (see
``TorchEngine``), so one large request cannot hold the server.

Without an ``api_key`` every endpoint is open to whoever reaches the port: ``/abort_requests`` aborts every
request, ``/update_weights`` loads weights from wherever ``update_info`` points. The default bind address,
127.0.0.1, limits that to local users; ``serve`` warns when it listens elsewhere without a key.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Awaitable
from typing import Any

import structlog
from aiohttp import web

from rollflow.errors import ConfigError, EngineDeadError, EngineError, WeightReceiveError
from rollflow.http.auth import bearer_token_matches
from rollflow.http.limits import HttpLimits
from rollflow.http.runner import JSONErrorAppRunner
from rollflow.inference.engine.engine import TorchEngine
from rollflow.inference.engine.server_admin import EngineServerAdmin
from rollflow.inference.engine.server_protocol import (
    ApiError,
    FinishWeightUpdateBody,
    InitWeightTransferBody,
    StartWeightUpdateBody,
    UpdateWeightsBody,
    WeightCheckerBody,
    bad_request,
    decode_body,
    engine_dead,
    error_response,
    json_response,
)
from rollflow.inference.prompt_limits import max_prompt_chars
from rollflow.inference.request_limits import RequestLimits
from rollflow.weights.server.receiver import create_receiver, init_timeout_s
from rollflow.weights.server.state import ReceiverFactory, WeightReceiveState

log = structlog.get_logger(__name__)

# Request bodies above this are refused with 413 (a 128k-token prompt is about 1 MB of JSON).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Entries kept by the control log (the oldest go first).
CONTROL_LOG_SIZE = 10_000
# Paths open without the bearer token when the server has an API key: probes and scrapers carry no secret.
# (vLLM itself guards only /v1/*; this server guards the control plane and /inference/v1/* too.)
OPEN_PATHS = frozenset({"/health", "/metrics"})
# The HTTP status of each kind of WeightReceiveError: a bad call, a conflicting one, a failed peer.
WEIGHT_ERROR_STATUS = {"invalid": 400, "conflict": 409, "failed": 502}


class EngineServer(EngineServerAdmin):
    """State and handlers of one engine server. Build with ``from_model`` (blocking: loads the model) or
    directly around an engine; ``await start(host, port)`` serves, ``await close()`` stops.

    Args:
        engine: the engine served; ``close`` shuts it down.
        tokenizer: the model's Hugging Face tokenizer (text endpoints, eos ids).
        served_model_name: the ``model`` name clients must send (or omit); others get 404.
        renderer: a ``renderers`` chat renderer for ``/v1/chat/completions``; None disables chat (400).
        api_key: bearer token every endpoint but ``OPEN_PATHS`` requires (401 without it); None: no check.
        receiver_factory: builds the weight receiver on ``/init_weight_transfer_engine``; the default is
            ``rollflow.weights.server.receiver.create_receiver``. Tests inject fakes here.
        eos_token_ids: token ids that end a generation unless ``ignore_eos``; default: the tokenizer's eos.
        max_body_bytes: larger request bodies get 413.
        http_limits: read timeouts and the connection cap (``rollflow.http.limits.HttpLimits``).
        request_limits: the most sequences and tokens one generation request may ask for
            (``rollflow.inference.request_limits.RequestLimits``); more is a 400.
    """

    def __init__(
        self,
        engine: TorchEngine,
        tokenizer: Any,
        *,
        served_model_name: str,
        model_path: str = "",
        renderer: Any = None,
        api_key: str | None = None,
        receiver_factory: ReceiverFactory | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        http_limits: HttpLimits | None = None,
        request_limits: RequestLimits | None = None,
    ):
        # Fixed components.
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.served_model_name = served_model_name
        self.model_path = model_path or served_model_name
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.http_limits = http_limits or HttpLimits()
        self.request_limits = request_limits or RequestLimits()
        self.receiver_factory = receiver_factory or create_receiver
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = (eos,) if eos is not None else ()
        self.eos_token_ids = tuple(eos_token_ids)
        self.created = int(time.time())
        # Text prompts longer than this cannot fit max_model_len tokens: refused before tokenizing.
        self.max_prompt_chars = max_prompt_chars(engine.max_model_len, tokenizer)
        # Renders of large chats run in worker threads; renderers keep caches not documented as thread-safe.
        self.render_lock = threading.Lock()

        # Runtime state: pause and sleep. A pause from /pause and one from /sleep are tracked apart, so that
        # /resume does not wake a sleeping server and /wake_up does not resume a paused one.
        self.pause_mode: str | None = None
        self.sleep_mode: str | None = None
        self.sleep_level: int | None = None
        self.sleeping_tags: set[str] = set()
        self._control_lock = asyncio.Lock()
        # Every control call in order (GET /control_log): how a colocated run's sleep/wake cycle is checked.
        self.control_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=CONTROL_LOG_SIZE)
        self._control_counts: collections.Counter[str] = collections.Counter()

        # Runtime state: weight transfer (vLLM's lifecycle: init once; then start -> update* -> finish).
        self.weights = WeightReceiveState(self.receiver_factory)

        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    # ------------------------------------------------------------------ construction and lifecycle

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        return_routed_experts: bool = False,
        device: str = "auto",
        logprobs_mode: str = "processed_logprobs",
        max_request_share: float | None = None,
        adapter_versions: int = 0,
        **kwargs: Any,
    ) -> EngineServer:
        """Load ``model`` (``rollflow:tiny``, a local HF directory or a cached HF name) and wrap it. Blocking.

        ``max_model_len`` defaults to the model's ``max_position_embeddings``, at most 2048.
        ``return_routed_experts`` (MoE models): generate responses carry each choice's ``routed_experts``.
        ``device``: ``auto`` (CUDA when available), ``cpu`` or ``cuda``; the engine computes in float32.
        ``logprobs_mode``: vLLM's ``--logprobs-mode`` (``TorchEngine``'s ``logprobs_mode``).
        ``max_request_share``: ``TorchEngine``'s latency-first cap (None: off).
        ``adapter_versions``: LoRA versions kept unmerged (``TorchEngine``'s; 0 merges each push).

        Raises:
            ModelNotFoundError: the model cannot be resolved locally.
            EngineError: the architecture is not supported, or ``return_routed_experts`` for a dense model.
            ConfigError: ``device`` is unknown or not available (``cuda`` without CUDA).
            ValueError: ``max_batch_size``, ``max_model_len`` or ``max_request_share`` out of range.
        """
        from rollflow.config import ModelConfig
        from rollflow.models.loading import (
            create_chat_renderer,
            load_causal_lm,
            load_tokenizer,
            resolve_device,
            resolve_model_path,
        )

        torch_device = resolve_device(device, "--device")
        model_dir = resolve_model_path(model)
        tokenizer = load_tokenizer(model_dir)
        causal_lm = load_causal_lm(model_dir, device=torch_device)
        if max_model_len is None:
            max_model_len = min(getattr(causal_lm.config, "max_position_embeddings", 2048) or 2048, 2048)
        engine = TorchEngine(
            causal_lm,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            return_routed_experts=return_routed_experts,
            logprobs_mode=logprobs_mode,
            max_request_share=max_request_share,
            adapter_versions=adapter_versions,
        )
        try:
            renderer = create_chat_renderer(tokenizer, ModelConfig(path=model))
        except ConfigError as error:
            log.warning("chat completions disabled: no chat renderer", model=model, error=str(error))
            renderer = None
        eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        generation_eos = getattr(getattr(causal_lm, "generation_config", None), "eos_token_id", None)
        if isinstance(generation_eos, int):
            eos_ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            eos_ids.update(generation_eos)
        return cls(
            engine,
            tokenizer,
            served_model_name=served_model_name or model,
            model_path=str(model_dir),
            renderer=renderer,
            api_key=api_key,
            eos_token_ids=tuple(sorted(eos_ids)),
            **kwargs,
        )

    def build_app(self) -> web.Application:
        """The aiohttp application (middlewares and routes). Serve it with ``handler_cancellation=True``."""
        from rollflow.inference.engine.server_routes import DataPlane

        app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=[self._error_middleware, self._auth_middleware]
        )
        data = DataPlane(self)
        app.router.add_routes(
            [
                web.post("/inference/v1/generate", data.generate),
                web.post("/v1/completions", data.completions),
                web.post("/v1/chat/completions", data.chat_completions),
                web.post("/tokenize", data.tokenize),
                web.post("/detokenize", data.detokenize),
                web.get("/v1/models", data.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.get("/is_paused", self.is_paused),
                web.post("/sleep", self.sleep),
                web.post("/wake_up", self.wake_up),
                web.get("/is_sleeping", self.is_sleeping),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.post("/abort_requests", self.abort_requests),
                web.post("/inference/v1/abort_requests", self.inference_abort_requests),
                web.get("/get_world_size", self.get_world_size),
                web.post("/init_weight_transfer_engine", self.init_weight_transfer_engine),
                web.post("/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine),
                web.post("/start_weight_update", self.start_weight_update),
                web.post("/update_weights", self.update_weights),
                web.post("/finish_weight_update", self.finish_weight_update),
                web.get("/weight_info", self.weight_info),
                web.post("/weight_checker", self.weight_checker),
                web.get("/control_log", self.get_control_log),
            ]
        )
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (port 0 picks a free one) and return the base URL.

        Raises:
            OSError: the address cannot be bound.
        """
        # JSONErrorAppRunner: even requests aiohttp cannot parse get the error JSON.
        runner = JSONErrorAppRunner(
            self.build_app(), limits=self.http_limits, handler_cancellation=True, access_log=None
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_host, bound_port = runner.addresses[0][:2]
        shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown_host}:{bound_port}"
        return self.url

    async def close(self) -> None:
        """Stop listening, shut the engine down (aborting requests) and close the weight receiver. Idempotent."""
        # Engine first: its aborted requests answer their clients before the runner drops the connections.
        await self.engine.shutdown()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self.weights.close()

    # ------------------------------------------------------------------ shared by the data plane

    def check_accepting(self) -> None:
        """Raise 503 ``ServiceUnavailableError`` while paused (or asleep) in abort or wait mode, and 503
        ``EngineDeadError`` once the engine died (checked first: a dead engine never resumes)."""
        if self.engine.is_dead:
            raise engine_dead(self.engine.dead_reason)
        for state, mode in (("paused", self.pause_mode), ("sleeping", self.sleep_mode)):
            if mode in ("abort", "wait"):
                raise ApiError(
                    503,
                    f"the server is {state} (mode={mode}) and takes no new requests; retry after it resumes",
                )

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            # Also for endpoints that never read their body (aiohttp checks the size only on read).
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise ApiError(
                    413, f"request body of {request.content_length} bytes exceeds {self.max_body_bytes}"
                )
            return await handler(request)
        except ApiError as error:
            return error.response()
        except web.HTTPException as error:
            if error.status < 400:
                raise
            message = (
                error.reason if error.text is None or error.text.startswith(str(error.status)) else error.text
            )
            if error.status == 413:
                message = f"request body exceeds {self.max_body_bytes} bytes: {error.text}"
            elif error.status in (404, 405):
                message = f"{error.reason}: {request.method} {request.path}"
            return error_response(error.status, message)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("unhandled error in handler", path=request.path)
            return error_response(500, "internal server error; see the server log")

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if (
            self.api_key is not None
            and request.path not in OPEN_PATHS
            and not bearer_token_matches(request.headers.get("Authorization"), self.api_key)
        ):
            raise ApiError(401, "missing or wrong bearer token; send 'Authorization: Bearer <api key>'")
        return await handler(request)

    # ------------------------------------------------------------------ shared by the control endpoints

    async def _read(self, request: web.Request, type_: type, *, empty_ok: bool = False) -> Any:
        return decode_body(await request.read(), type_, empty_ok=empty_ok)

    async def _engine_call(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except EngineDeadError as error:
            raise engine_dead(error) from None

    # ------------------------------------------------------------------ weight transfer

    async def _shielded(self, work: Awaitable[Any]) -> Any:
        # A client that disconnects mid-transfer must not leave the weights or the receiver half-set.
        return await asyncio.shield(asyncio.ensure_future(work))

    async def _weight_call(self, work: Awaitable[Any]) -> Any:
        """``work`` (a ``WeightReceiveState`` call) shielded, its refusals answered with their status."""
        try:
            return await self._shielded(work)
        except WeightReceiveError as error:
            raise ApiError(WEIGHT_ERROR_STATUS[error.kind], str(error), error.param) from None

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /init_weight_transfer_engine``: build a new receiver from ``init_info``, replacing the old one.

        ``init_info.timeout_s`` (default 300) bounds the whole call: past it the answer is a 502 naming it,
        whatever the receiver's construction waits on (a trainer rendezvous that accepts the connection and
        never answers). A later init supersedes this one (``WeightReceiveState.init``).
        """
        body = await self._read(request, InitWeightTransferBody)
        try:
            timeout_s = init_timeout_s(body.init_info)
        except ValueError as error:
            raise bad_request(f"invalid init_info: {error}", "init_info") from None
        await self._weight_call(self.weights.init(body.init_info, timeout_s))
        return json_response({"message": "Weight transfer initialized"})

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        await self.weights.shutdown()
        return json_response({"message": "Weight transfer shut down"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        await self._read(request, StartWeightUpdateBody, empty_ok=True)
        await self._weight_call(self.weights.start(self.engine.policy_version))
        return json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``POST /update_weights``: receive one round of weights and load them. ``update_info`` says where
        they come from, which for the checkpoint strategy is any local path or URL the server can read:
        behind the API key when one is set; without one, open to whoever reaches the server (on loopback:
        every local user). A ``policy_version`` below one loaded since ``/init_weight_transfer_engine`` is a
        409 (the tensors are received first: the trainer's broadcast needs every receiver)."""
        body = await self._read(request, UpdateWeightsBody)

        async def load(tensors: Any, version: int) -> None:
            if "weights" in self.sleeping_tags:
                raise ApiError(
                    409,
                    f"the weights are asleep (sleep level {self.sleep_level}): POST /wake_up?tags=weights "
                    "before /update_weights; the tensors received were discarded",
                    "update_info",
                )
            try:
                await self._engine_call(self.engine.load_weights(tensors, policy_version=version))
            except EngineError as error:
                # Refused before anything was copied (non-finite, unknown or misshapen tensors): the old
                # weights keep serving, and this round is over; the trainer starts a new one.
                self.weights.end_round()
                raise bad_request(str(error), "update_info") from None
            self.record("update_weights", version=version, tensors=len(tensors))

        await self._weight_call(self.weights.update(body.update_info, load))
        return json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        body = await self._read(request, FinishWeightUpdateBody, empty_ok=True)
        version: int | None = None
        if body.weight_version is not None:
            try:
                version = int(body.weight_version)
            except ValueError:
                raise bad_request(
                    f"weight_version {body.weight_version!r} is not an integer policy version",
                    "weight_version",
                ) from None

        async def label(version: int) -> None:
            if version != self.engine.policy_version:
                await self._engine_call(self.engine.load_weights([], policy_version=version))

        await self._weight_call(self.weights.finish(version, label))
        self.record("finish_weight_update")
        return json_response({"message": "Weight update finished"})

    async def weight_checker(self, request: web.Request) -> web.Response:
        """``POST /weight_checker {"action": "checksum"}``: SHA-256 of the LoRA adapter tensors the engine
        serves, as received (``rollflow.weights.delivery``'s proof of delivery); empty before any adapter."""
        await self._read(request, WeightCheckerBody)
        return json_response({"checksums": self.engine.adapter_checksums()})

    async def weight_info(self, request: web.Request) -> web.Response:
        version = self.engine.policy_version
        return json_response({"weight_version": str(version), "policy_version": version})
