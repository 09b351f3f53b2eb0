"""The rollflow exception family."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class RollflowError(Exception):
    """Base class of every error rollflow raises on purpose."""


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


class RunDirectoryInUseError(RollflowError):
    """Another live process holds the run directory's lock (a second run with the same name, or a resume
    of a run that is still running)."""


class StorageError(RollflowError):
    """A file of the run (metrics, rollouts, config, checkpoint) could not be written: disk full, no
    permission, read-only file system. The message names the path."""


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
