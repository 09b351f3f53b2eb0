"""The rollflow exception family."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class RollflowError(Exception):
    """Base class of every error rollflow raises on purpose.

    ``retryable`` says whether the same call may succeed later without any change (a server that is
    restarting or paused, a broken connection): callers decide to retry from it, never from the message.
    """

    retryable: bool = False


def is_retryable(error: BaseException) -> bool:
    """Whether ``error`` belongs to a retryable family (``RollflowError.retryable``); anything else is not."""
    return isinstance(error, RollflowError) and error.retryable


class ConfigError(RollflowError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent with another."""


class PlacementError(ConfigError):
    """The cluster cannot hold the run's processes as configured (too few GPUs or CPUs, a tensor-parallel
    group larger than a node, placement groups not granted in time, an unreachable cluster); the message
    names what was asked, what the cluster has and the config keys to change."""


class ModelNotFoundError(RollflowError, FileNotFoundError):
    """A model path or name could not be resolved to a local model."""


class MissingExtraError(RollflowError, ImportError):
    """An optional dependency is not installed; the message names the install command."""


# ---------------------------------------------------------------- error codes and the JSON error body
#
# Every rollflow HTTP listener (engine server, router, TITO proxy) answers errors with ``error_body``, so one
# error reads the same wherever it is answered: ``type`` is the vLLM/OpenAI-SDK class name of its HTTP status
# (``BadRequestError``), ``code`` a stable string callers switch on (``context_length_exceeded``).

#: A request the server refuses as given (the generic 400).
INVALID_REQUEST = "invalid_request"
#: The prompt (with room for one output token) does not fit the model's context length.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: Nothing can serve the request now (paused, no healthy server, over capacity); the same request may
#: succeed later.
SERVICE_UNAVAILABLE = "service_unavailable"
#: The engine's loop died; nothing is served until the server restarts.
ENGINE_DEAD = "engine_dead"
#: A failure inside the server (a bug), not caused by the request.
INTERNAL_ERROR = "internal_error"

# status: (type, code); statuses not listed get their phrase as type and code.
_STATUS_ERRORS = {
    400: ("BadRequestError", INVALID_REQUEST),
    401: ("AuthenticationError", "unauthorized"),
    403: ("PermissionDeniedError", "forbidden"),
    404: ("NotFoundError", "not_found"),
    405: ("MethodNotAllowedError", "method_not_allowed"),
    408: ("RequestTimeoutError", "request_timeout"),
    409: ("ConflictError", "conflict"),
    413: ("RequestEntityTooLargeError", "request_too_large"),
    415: ("UnsupportedMediaTypeError", "unsupported_media_type"),
    422: ("UnprocessableEntityError", "unprocessable_entity"),
    500: ("InternalServerError", INTERNAL_ERROR),
    502: ("BadGatewayError", "bad_gateway"),
    503: ("ServiceUnavailableError", SERVICE_UNAVAILABLE),
    504: ("GatewayTimeoutError", "gateway_timeout"),
}


def error_type(status: int) -> str:
    """The ``error.type`` of an HTTP status (``BadRequestError`` for 400, as vLLM and the OpenAI SDK name it)."""
    known = _STATUS_ERRORS.get(status)
    if known is not None:
        return known[0]
    return "BadRequestError" if status < 500 else "InternalServerError"


def error_code(status: int) -> str:
    """The default ``error.code`` of an HTTP status (``invalid_request`` for 400)."""
    known = _STATUS_ERRORS.get(status)
    if known is not None:
        return known[1]
    return INVALID_REQUEST if status < 500 else INTERNAL_ERROR


def error_body(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, dict[str, str | None]]:
    """The JSON error every rollflow listener answers: ``{"error": {"message", "type", "param", "code"}}``,
    ``type`` and ``code`` defaulting to those of ``status`` (``engine_dead`` for the ``EngineDeadError`` type)."""
    if code is None and type == ENGINE_DEAD_TYPE:
        code = ENGINE_DEAD
    return {
        "error": {
            "message": message,
            "type": type or error_type(status),
            "param": param,
            "code": code or error_code(status),
        }
    }


# ---------------------------------------------------------------- inference: one family, local or remote


class InferenceError(RollflowError):
    """A call to the inference engines failed, in this process or over HTTP.

    Attributes:
        code: the wire ``error.code`` of this failure (``context_length_exceeded``, ``invalid_request`` …);
            the same for a local engine and a remote server.
        param: the request field at fault, when one is.
        http_status: the status a server answers this failure with.
    """

    code: str = INTERNAL_ERROR
    http_status: int = 500

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param


class EngineError(InferenceError):
    """One request cannot be served as given (a 4xx): empty or too long prompt, token outside the vocabulary,
    sampling values out of range, weights that do not fit. The engine keeps serving; retrying the same
    request fails the same way."""

    code = INVALID_REQUEST
    http_status = 400


class ContextLengthExceededError(EngineError):
    """The prompt leaves no room for output in the model's context (``max_model_len``)."""

    code = CONTEXT_LENGTH_EXCEEDED


class EngineGenerateError(EngineError):
    """One generate request failed inside the engine (not because of its input); the engine keeps serving,
    and the same request may succeed again."""

    code = INTERNAL_ERROR
    http_status = 500
    retryable = True


class EngineDeadError(InferenceError):
    """The engine's loop has died; no further requests can be served (not retryable: restart the server)."""

    code = ENGINE_DEAD
    http_status = 503


class ServerDiedError(EngineDeadError):
    """A process rollflow started for inference (a managed server or the router) died while it was in use,
    and the run failed; the failed call is this error's ``__cause__``. The message names each dead process:
    its URL and index, pid, exit code or signal, and its log's path with the log's last lines.

    Attributes:
        deaths: one line of text per dead process (``ServerDeath`` as text).
    """

    def __init__(self, message: str, deaths: list[str]):
        super().__init__(message)
        self.deaths = deaths


class InferenceUnavailableError(InferenceError):
    """Nothing served the call now (connection refused or reset, a 5xx, a server paused past the deadline);
    the same call may succeed later."""

    code = SERVICE_UNAVAILABLE
    http_status = 503
    retryable = True


class RemoteInferenceError(InferenceError):
    """An HTTP call to an inference server, router or proxy failed; the message names the URL.

    Attributes:
        url: the URL that failed.
        status: the HTTP status, or None when no response came back (connection error, timeout).
        body: the decoded JSON error body, when the server sent one.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        status: int | None = None,
        body: object = None,
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message, code=code, param=param)
        self.url = url
        self.status = status
        self.body = body


class RemoteRequestError(RemoteInferenceError, EngineError):
    """A server refused the request (a 4xx); ``code`` and ``param`` are the server's."""

    def __init__(self, message: str, *, url: str, status: int, **fields: object):
        super().__init__(message, url=url, status=status, **fields)  # type: ignore[arg-type]
        self.http_status = status


class RemoteContextLengthExceededError(RemoteRequestError, ContextLengthExceededError):
    """A server answered ``context_length_exceeded``: the prompt does not fit its context."""


class RemoteUnavailableError(RemoteInferenceError, InferenceUnavailableError):
    """No server answered the call usefully: connection errors past the retries, a 5xx, or 503s (paused,
    no healthy server) until ``request_timeout_s`` ran out. Retryable."""


class RemoteEngineDeadError(RemoteInferenceError, EngineDeadError):
    """The server (or every server behind the router) answered that its engine died (503 with error type
    ``EngineDeadError``): unlike a pause it does not pass, so calls fail at once instead of waiting."""


class ControlPlaneError(RemoteInferenceError):
    """A control-plane call failed on at least one server; ``failures`` maps each failed server URL to
    its error, and the message lists them all. Retryable when every failure is."""

    def __init__(self, action: str, failures: dict[str, RemoteInferenceError]):
        lines = "; ".join(f"{url}: {error}" for url, error in failures.items())
        first = next(iter(failures.values()))
        super().__init__(
            f"{action} failed on {len(failures)} server(s): {lines}", url=first.url, status=first.status
        )
        self.failures = failures
        self.retryable = all(error.retryable for error in failures.values())


class CheckpointError(RollflowError):
    """A checkpoint is missing, incomplete or does not match the run it is resumed into."""


# ``error.type`` of the 503 an engine server answers once its engine died (data plane, control plane, /health).
# Unlike a pause's 503 (``ServiceUnavailableError``: retry later) it never recovers without a restart, so the
# router takes such a server out and clients stop waiting.
ENGINE_DEAD_TYPE = EngineDeadError.__name__


class RunDirectoryInUseError(RollflowError):
    """Another live process holds the run directory's lock (a second run with the same name, or a resume
    of a run that is still running)."""


class StorageError(RollflowError):
    """A file of the run (metrics, rollouts, config, checkpoint) could not be written: disk full, no
    permission, read-only file system. The message names the path."""


class RunDirectoryGoneError(StorageError):
    """The run directory was deleted or replaced while the run held it (its lock file is gone or is another
    file): the run stops rather than write into a recreated directory. The message names the directory."""


def describe_os_error(error: OSError, path: str | os.PathLike[str]) -> str:
    """``cannot write PATH: <reason>`` with the free space of its file system when the disk is full.

    ``error`` may carry no file name (a failed ``write`` or ``flush`` does not), so the path is given."""
    reason = error.strerror or str(error)
    message = f"cannot write {os.fspath(path)}: {reason}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        message += f" ({_free_space(path)}); free some space or set output_dir to a larger disk"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        message += "; make it writable or set output_dir to a writable directory"
    return message


def _free_space(path: str | os.PathLike[str]) -> str:
    import shutil

    for candidate in (os.fspath(path), *(os.fspath(p) for p in Path(path).parents)):
        try:
            free = shutil.disk_usage(candidate).free
        except OSError:
            continue
        return f"{free / 2**20:.1f} MiB free on its file system"
    return "free space unknown"


# ---------------------------------------------------------------- weights and the weight barrier


class WeightTransferError(RollflowError):
    """A weight transfer failed; the message says which side (a server's URL, or a trainer rank) and why.

    Retryable: the next push reconnects (a new group, the servers that are left).

    Attributes:
        rank: the trainer rank that failed, once known (None for the servers' side).
    """

    retryable = True
    rank: int | None = None


class InvalidTransferInfoError(WeightTransferError, ValueError):
    """An ``init_info`` or ``update_info`` is malformed (a server answers it with a 400); not retryable."""

    retryable = False


class WeightTransferTimeoutError(WeightTransferError, TimeoutError):
    """A weight transfer (or forming its process group) did not finish within its timeout; not retried (a
    retry would wait as long again)."""

    retryable = False


class WeightReceiveError(WeightTransferError):
    """An engine server refused or failed one weight-transfer call (``WeightReceiveState``); the server's
    handler answers it with the status ``kind`` names.

    Attributes:
        kind: ``"invalid"`` (a malformed payload or a call out of order: 400), ``"conflict"`` (a stale
            version, or a call superseded by a newer init: 409), ``"failed"`` (the transfer's peer failed or
            timed out: 502).
        param: the request field at fault (``"init_info"``, ``"update_info"``, ``"weight_version"``), if one.
    """

    retryable = False

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.param = param


class WeightSyncTimeoutError(RollflowError, TimeoutError):
    """A weight update did not finish within ``weight_sync.timeout_s``."""


# ---------------------------------------------------------------- rollouts


class AgentError(RollflowError):
    """The agent failed: it raised, exited non-zero, or did not report a usable reward."""


class EnvError(RollflowError):
    """An environment (``[env]``) failed one trajectory: it raised, timed out or lost its server."""


class EnvFailureRateError(RollflowError):
    """Too many of an environment's recent trajectories failed (``env.max_failure_rate``): the run stops
    instead of training on what is left."""


class RewardPartError(RollflowError):
    """A part of a weighted reward failed; names it."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"reward {name!r}: {type(error).__name__}: {error}")
        self.name = name


class PromptTooLongError(ConfigError):
    """A prompt of the run's data cannot fit the engines' context (``inference.max_model_len``) while
    ``data.on_bad_row = "fail"``; the message names the row (file and line for JSONL) and the fixes."""


class CallbackTimeoutError(RollflowError, TimeoutError):
    """A user callback (a reward, a custom task's ``item``) ran past its timeout; the message names the
    callback and the timeout's config key.

    Attributes:
        timeout_s: the timeout that ran out, in seconds.
    """

    def __init__(self, message: str, *, timeout_s: float):
        super().__init__(message)
        self.timeout_s = timeout_s


class StuckCallbacksError(RollflowError):
    """Too many calls of one sync user callback ran past their timeout and still hold a thread each (a thread
    cannot be killed): the callback blocks, and the run stops instead of piling up threads."""


class NothingToTrainError(RollflowError):
    """``orchestrator.max_masked_steps`` steps in a row had every sample masked: the run would train nothing.
    The message counts the mask reasons and names the last problem."""


# ---------------------------------------------------------------- the TITO proxy


class RequestError(RollflowError):
    """A request the TITO proxy refuses; carries the HTTP status and the error fields (``error_body``)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code or error_code(status)
        self.type = type or error_type(status)

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.status, self.message, type=self.type, param=self.param, code=self.code)


class TraceSealedError(RollflowError):
    """The session was closed: its trace takes no more turns."""


class RoutedExpertsError(RollflowError):
    """Routed-expert indices of a generation do not have the shape ``[tokens, layers, topk]`` of integers."""
