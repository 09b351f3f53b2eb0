"""The rollflow exception family."""

from __future__ import annotations


class RollflowError(Exception):
    """Base class of every error rollflow raises on purpose."""


class ConfigError(RollflowError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent with another."""


class ModelNotFoundError(RollflowError, FileNotFoundError):
    """A model path or name could not be resolved to a local model."""


class MissingExtraError(RollflowError, ImportError):
    """An optional dependency is not installed; the message names the install command."""


class EngineError(RollflowError):
    """A recoverable failure of one generate request (the engine keeps serving)."""


class EngineGenerateError(EngineError):
    """One generate request failed inside the engine (not because of its input); the engine keeps serving."""


class EngineDeadError(RollflowError):
    """The engine's loop has died; no further requests can be served."""


class CheckpointError(RollflowError):
    """A checkpoint is missing, incomplete or does not match the run it is resumed into."""


# ``error.type`` of the 503 an engine server answers once its engine died (data plane, control plane, /health).
# Unlike a pause's 503 (``ServiceUnavailableError``: retry later) it never recovers without a restart, so the
# router takes such a server out and clients stop waiting.
ENGINE_DEAD_TYPE = EngineDeadError.__name__
