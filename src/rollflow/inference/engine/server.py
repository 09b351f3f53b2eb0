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
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from rollflow.errors import ConfigError, EngineDeadError, EngineError
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
    bad_request,
    decode_body,
    engine_dead,
    error_response,
    json_response,
)
from rollflow.inference.prompt_limits import max_prompt_chars
from rollflow.inference.request_limits import RequestLimits
from rollflow.weights.ranks import FIRST_WORKER_RANK, update_list_index
from rollflow.weights.receiver import init_timeout_s

log = structlog.get_logger(__name__)

# Request bodies above this are refused with 413 (a 128k-token prompt is about 1 MB of JSON).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Entries kept by the control log (the oldest go first).
CONTROL_LOG_SIZE = 10_000
# Paths open without the bearer token when the server has an API key: probes and scrapers carry no secret.
# (vLLM itself guards only /v1/*; this server guards the control plane and /inference/v1/* too.)
OPEN_PATHS = frozenset({"/health", "/metrics"})

# create_receiver(init_info, worker_rank) -> receiver with receive(update_info) and close(); both blocking.
ReceiverFactory = Callable[[dict[str, Any], int], Any]


def _default_receiver_factory(init_info: dict[str, Any], worker_rank: int) -> Any:
    from rollflow.weights.receiver import create_receiver

    return create_receiver(init_info, worker_rank)


def _close_quietly(receiver: Any) -> None:
    """``receiver.close()``, a failure logged: a receiver nobody uses any more."""
    close = getattr(receiver, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            log.exception("closing an unused weight receiver failed")


def _in_daemon_thread(function: Callable[..., Any], *args: Any) -> asyncio.Future:
    """A future of ``function(*args)`` run in a new daemon thread. Unlike ``asyncio.to_thread`` it holds no
    worker of the loop's executor, so a call that blocks for good (a peer that never answers) costs one idle
    thread, not the executor the server's other blocking work needs."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:  # handed to the future
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            if error is None:
                _close_quietly(result)

    threading.Thread(target=run, name="rollflow-weight-init", daemon=True).start()
    return future


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
            ``rollflow.weights.receiver.create_receiver``. Tests inject fakes here.
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
        self.receiver_factory = receiver_factory or _default_receiver_factory
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
        self._receiver: Any = None
        self._init_info: dict[str, Any] = {}
        self._update_active = False
        self._update_epoch = 0  # the transfer session (_epoch) the active update was started in
        self._pending_version = 0
        # The newest version loaded since init_weight_transfer_engine: older ones are refused.
        self._version_floor: int | None = None
        self._weights_lock = asyncio.Lock()
        # Each init_weight_transfer_engine starts a new transfer session (epoch). A receive blocked on a peer
        # that died must not hold the server hostage: it runs outside _weights_lock, a new init supersedes it,
        # and whatever it returns late is discarded.
        self._epoch = 0
        self._receive_lock = asyncio.Lock()
        self._receive_in_flight = False

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
        **kwargs: Any,
    ) -> EngineServer:
        """Load ``model`` (``rollflow:tiny``, a local HF directory or a cached HF name) and wrap it. Blocking.

        ``max_model_len`` defaults to the model's ``max_position_embeddings``, at most 2048.
        ``return_routed_experts`` (MoE models): generate responses carry each choice's ``routed_experts``.
        ``device``: ``auto`` (CUDA when available), ``cpu`` or ``cuda``; the engine computes in float32.
        ``logprobs_mode``: vLLM's ``--logprobs-mode`` (``TorchEngine``'s ``logprobs_mode``).

        Raises:
            ModelNotFoundError: the model cannot be resolved locally.
            EngineError: the architecture is not supported, or ``return_routed_experts`` for a dense model.
            ConfigError: ``device`` is unknown or not available (``cuda`` without CUDA).
            ValueError: ``max_batch_size`` or ``max_model_len`` out of range.
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
        await self._close_receiver()

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

    async def _close_receiver(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None and hasattr(receiver, "close"):
            try:
                await asyncio.to_thread(receiver.close)
            except Exception:
                log.exception("closing the weight receiver failed")

    async def _shielded(self, work: Awaitable[Any]) -> Any:
        # A client that disconnects mid-transfer must not leave the weights or the receiver half-set.
        return await asyncio.shield(asyncio.ensure_future(work))

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        """``POST /init_weight_transfer_engine``: build a new receiver from ``init_info``, replacing the old one.

        ``init_info.timeout_s`` (default 300) bounds the whole call: past it the answer is a 502 naming it,
        whatever the receiver's construction waits on (a trainer rendezvous that accepts the connection and
        never answers). The construction runs outside the server's weights lock, so other weight calls and a
        new init are never held behind it; a later init supersedes it, and a receiver it returns late (after its
        timeout, or once superseded) is closed.
        """
        body = await self._read(request, InitWeightTransferBody)
        try:
            timeout_s = init_timeout_s(body.init_info)
        except ValueError as error:
            raise bad_request(f"invalid init_info: {error}", "init_info") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def timed_out(what: str) -> ApiError:
            # 502: the trainer side (the upstream peer) did not answer in time, not this request's fault.
            return ApiError(
                502,
                f"weight transfer init did not complete within init_info.timeout_s = {timeout_s:g} s ({what}); "
                "check that the trainer side is running and reachable, or raise weight_sync.timeout_s",
                "init_info",
            )

        async def init() -> None:
            try:
                async with asyncio.timeout_at(deadline), self._weights_lock:
                    if self._receive_in_flight:
                        # The blocked receive owns the old receiver and closes it when it returns; its update
                        # round is abandoned.
                        self._receiver = None
                        self._update_active = False
                    else:
                        await self._close_receiver()
                    self._epoch += 1
                    epoch = self._epoch
                    self._version_floor = None
                    self._receive_lock = asyncio.Lock()
                    self._receive_in_flight = False
            except TimeoutError:
                raise timed_out("waiting for another weight call, or closing the previous receiver") from None
            # Blocking, and may join a torch.distributed group: off the event loop, outside the lock, and in a
            # thread of its own (one that never returns must not take a worker of the loop's executor).
            building = _in_daemon_thread(self.receiver_factory, body.init_info, 0)
            try:
                async with asyncio.timeout_at(deadline):
                    receiver = await asyncio.shield(building)
            except TimeoutError as error:
                failed = None if not building.done() or building.cancelled() else building.exception()
                if isinstance(failed, TimeoutError):  # the receiver's own deadline
                    raise timed_out(str(failed)) from None
                # This call's deadline: whatever the construction returns later is closed.
                building.add_done_callback(self._close_late_receiver)
                log.warning("weight transfer init timed out", timeout_s=timeout_s, error=repr(error))
                raise timed_out("the receiver was not ready") from None
            except (ValueError, TypeError, KeyError) as error:
                raise bad_request(f"invalid init_info: {error}", "init_info") from None
            except Exception as error:  # the trainer's group did not form: a failure, named
                log.exception("weight transfer init failed")
                # 502: the trainer side (the upstream peer) failed, not this request.
                raise ApiError(502, f"weight transfer init failed: {type(error).__name__}: {error}") from None
            async with self._weights_lock:
                if epoch != self._epoch:
                    await asyncio.to_thread(_close_quietly, receiver)
                    raise ApiError(
                        409,
                        "a later init_weight_transfer_engine superseded this one while its receiver was being "
                        "built; the later one is in force",
                    )
                self._receiver = receiver
                self._init_info = body.init_info

        await self._shielded(init())
        return json_response({"message": "Weight transfer initialized"})

    @staticmethod
    def _close_late_receiver(building: asyncio.Future) -> None:
        """Close the receiver an init that timed out built after all (in a thread: closing may block)."""
        if building.cancelled() or building.exception() is not None:
            return
        threading.Thread(target=_close_quietly, args=(building.result(),), daemon=True).start()

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        async with self._weights_lock:
            await self._close_receiver()
            self._update_active = False
        return json_response({"message": "Weight transfer shut down"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        await self._read(request, StartWeightUpdateBody, empty_ok=True)
        async with self._weights_lock:
            # An update started before the latest init_weight_transfer_engine was abandoned by the trainer
            # (it failed on another server, or on the trainer's side, and the trainer reconnected).
            if self._update_active and self._update_epoch == self._epoch:
                raise bad_request(
                    "start_weight_update was already called; call finish_weight_update before starting another"
                )
            self._update_active = True
            self._update_epoch = self._epoch
            self._pending_version = self.engine.policy_version + 1
        return json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``POST /update_weights``: receive one round of weights and load them. ``update_info`` says where
        they come from, which for the checkpoint strategy is any local path or URL the server can read:
        behind the API key when one is set; without one, open to whoever reaches the server (on loopback:
        every local user). A ``policy_version`` below one loaded since ``/init_weight_transfer_engine`` is a
        409 (the tensors are received first: the trainer's broadcast needs every receiver)."""
        body = await self._read(request, UpdateWeightsBody)

        async def update() -> None:
            async with self._weights_lock:
                if not self._update_active:
                    raise bad_request("start_weight_update must be called before update_weights.")
                if self._receiver is None:
                    raise bad_request("init_weight_transfer_engine must be called before update_weights.")
                update_info = body.update_info
                if isinstance(update_info, list):
                    # One entry per global inference worker; this server's single worker follows the trainer.
                    index = update_list_index(int(self._init_info.get("rank_offset", FIRST_WORKER_RANK)))
                    if not 0 <= index < len(update_info):
                        raise bad_request(
                            f"update_info is a list of {len(update_info)} but this worker's global index is "
                            f"{index} (init_info.rank_offset - 1)",
                            "update_info",
                        )
                    update_info = update_info[index]
                version = update_info.get("policy_version", self._pending_version)
                if isinstance(version, bool) or not isinstance(version, int):
                    raise bad_request(
                        f"update_info.policy_version must be an integer, got {version!r}", "update_info"
                    )
                receiver, epoch, receive_lock = self._receiver, self._epoch, self._receive_lock
            async with receive_lock:
                tensors = await self._receive(receiver, epoch, update_info)
            async with self._weights_lock:
                if epoch != self._epoch:
                    raise ApiError(
                        409,
                        "weight transfer was re-initialized while this update was receiving; "
                        "its tensors were discarded",
                    )
                # Checked after receiving: the trainer's broadcast needs every receiver, refused or not.
                self._check_version_not_older(version, "update_info.policy_version")
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
                    self._update_active = False
                    raise bad_request(str(error), "update_info") from None
                self._pending_version = version
                self._version_floor = version
                self.record("update_weights", version=version, tensors=len(tensors))

        await self._shielded(update())
        return json_response({"message": "Weights updated"})

    def _check_version_not_older(self, version: int, param: str) -> None:
        """409 for a policy version below one loaded in this transfer session: per-token versions would go
        backwards. A new ``/init_weight_transfer_engine`` (a new trainer, or a resumed run) starts over."""
        floor = self._version_floor
        if floor is not None and version < floor:
            raise ApiError(
                409,
                f"{param} = {version} is older than policy version {floor}, already loaded since "
                "init_weight_transfer_engine; versions only go forward within one transfer session (a new "
                "init_weight_transfer_engine starts another)",
                param.split(".", 1)[0],
            )

    async def _receive(self, receiver: Any, epoch: int, update_info: dict[str, Any]) -> Any:
        """Run the blocking receive off the loop, without holding ``_weights_lock``."""
        self._receive_in_flight = True
        try:
            return await asyncio.to_thread(receiver.receive, update_info)
        except (ValueError, TypeError, KeyError) as error:
            raise bad_request(f"invalid update_info: {error}", "update_info") from None
        except Exception as error:  # a broken or timed-out transfer: a failure, named
            log.exception("weight transfer failed")
            if epoch == self._epoch:
                self._update_active = False  # the round failed; the trainer starts a new one
            # 502: the transfer's peers (trainer, other workers) failed, not this request.
            raise ApiError(502, f"weight transfer failed: {type(error).__name__}: {error}") from None
        finally:
            if epoch == self._epoch:
                self._receive_in_flight = False
            elif hasattr(receiver, "close"):
                # Superseded while receiving: nobody else holds this receiver any more.
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(receiver.close)

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
        async with self._weights_lock:
            if not self._update_active:
                raise bad_request("start_weight_update must be called before finish_weight_update.")
            if version is not None:
                self._check_version_not_older(version, "weight_version")
            if version is not None and version != self.engine.policy_version:
                await self._engine_call(self.engine.load_weights([], policy_version=version))
            if version is not None:
                self._version_floor = version
            self._update_active = False
            self.record("finish_weight_update")
        return json_response({"message": "Weight update finished"})

    async def weight_info(self, request: web.Request) -> web.Response:
        version = self.engine.policy_version
        return json_response({"weight_version": str(version), "policy_version": version})
