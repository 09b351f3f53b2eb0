"""Checkpoints: trainer weights and optimizer, plus the orchestrator state that makes a resume exact.

Layout: ``{run_dir}/checkpoints/step_000050/`` with ``model.safetensors``, ``optimizer.pt`` and the Hugging Face
model directory ``hf/`` (written by the trainer) and ``state.json`` (written here, last). A checkpoint is built
in a ``.tmp`` directory and renamed into place, so a run killed mid-save never leaves a checkpoint that looks
complete; older checkpoints are pruned only after that rename, so a save that fails (a full disk) leaves the
last complete one in place.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from rollflow.errors import CheckpointError, describe_os_error

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"step_(\d{6,})")


class OrchestratorState(msgspec.Struct):
    """Everything besides weights and optimizer needed to continue a run exactly."""

    step: int = 0
    """Optimizer steps completed."""
    policy_version: int = 0
    """Version of the weights the engines hold; bumped by every weight-update barrier."""
    data_position: int = 0
    """Index of the first prompt not yet trained on: a resumed run starts generating here."""
    trained_ahead: list[int] = []
    """Prompts beyond ``data_position`` already trained (async modes train groups out of order); a resumed
    run skips them, so every prompt is trained exactly once."""

    def mark_trained(self, prompt_indices: Iterable[int]) -> None:
        """Record trained prompts and advance ``data_position`` over the contiguous trained prefix."""
        ahead = set(self.trained_ahead).union(prompt_indices)
        while self.data_position in ahead:
            ahead.remove(self.data_position)
            self.data_position += 1
        self.trained_ahead = sorted(ahead)


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        path
        for path in root.iterdir()
        if path.is_dir() and _STEP_DIR.fullmatch(path.name) and (path / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda path: int(_STEP_DIR.fullmatch(path.name)[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def save_checkpoint(
    run_dir: Path,
    state: OrchestratorState,
    save_trainer: Callable[[Path], None],
    keep: int,
) -> Path:
    """Write a checkpoint for ``state.step`` and prune all but the ``keep`` newest.

    Raises:
        CheckpointError: a file could not be written (disk full, permissions: the message names the path
            and says which complete checkpoint is left); the partial checkpoint is removed.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step_{state.step:06d}"
    staging = root / f"step_{state.step:06d}.tmp"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_trainer(staging)
        as_umask_allows(staging)
        state_path = staging / STATE_FILE
        try:
            state_path.write_bytes(msgspec.json.encode(state))
        except OSError as error:
            raise CheckpointError(describe_os_error(error, state_path)) from None
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except Exception as error:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(_save_failure(run_dir, staging, error)) from error
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def as_umask_allows(directory: Path) -> None:
    """Give every file under ``directory`` the mode a new file gets (``0o666`` less the umask). safetensors
    writes its files 0600 whatever the umask, so a checkpoint's weights (and the ``hf/`` model beside them)
    could not be loaded by another user, e.g. a server run under another account."""
    mode = 0o666 & ~_umask()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _save_failure(run_dir: Path, staging: Path, error: Exception) -> str:
    """Why a save failed, where, and what is left. The trainer's writers do not always say (torch.save on a
    full disk raises ``unexpected pos`` or ``basic_ios::clear: iostream error``), so the free space is
    compared with the size of the last checkpoint here."""
    latest = latest_checkpoint(run_dir)
    if isinstance(error, CheckpointError):
        reason = str(error)
    elif isinstance(error, OSError):
        reason = describe_os_error(error, error.filename or staging)
    else:
        reason = f"cannot write checkpoint {staging}: {type(error).__name__}: {error}"
        needed = _size(latest) if latest is not None else 2**20
        try:
            free = shutil.disk_usage(staging.parent).free
        except OSError:
            free = None
        if free is not None and free < needed:
            reason += (
                f" (its file system has {free / 2**20:.1f} MiB free, less than a checkpoint's "
                f"{needed / 2**20:.1f} MiB: the disk is full; free some space or set output_dir to a larger disk)"
            )
    left = f"the last complete checkpoint, {latest}, is intact" if latest else "no complete checkpoint yet"
    return f"{reason}; {left}"


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def load_state(checkpoint: Path) -> OrchestratorState:
    """Raises:
    CheckpointError: the state file is missing or unreadable."""
    try:
        return msgspec.json.decode((checkpoint / STATE_FILE).read_bytes(), type=OrchestratorState)
    except (OSError, msgspec.DecodeError) as error:
        raise CheckpointError(f"checkpoint {checkpoint} has no readable {STATE_FILE}: {error}") from None


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint directory, else the latest checkpoint of the run directory
    ``path``.

    Raises:
        CheckpointError: ``path`` is neither, or the run has no complete checkpoint yet.
    """
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint (it has no {STATE_FILE}) nor a run directory with a complete "
            f"checkpoint under {checkpoints_dir(path).name}/"
        )
    return latest


def load_policy_weights(checkpoint: Path) -> tuple[dict[str, Any], int]:
    """The model weights of a checkpoint (Hugging Face names, on CPU) and the policy version they are: from
    its Hugging Face directory ``hf/`` when it has one (all its safetensors shards), else from the trainer's
    ``model.safetensors``.

    Raises:
        CheckpointError: the state or weights file is missing or unreadable.
    """
    from safetensors.torch import load_file

    from rollflow.train.export import HF_DIR
    from rollflow.train.trainer import WEIGHTS_FILE

    state = load_state(checkpoint)
    shards = sorted((checkpoint / HF_DIR).glob("*.safetensors"))
    files = shards or [checkpoint / WEIGHTS_FILE]
    weights: dict[str, Any] = {}
    for path in files:
        try:
            weights.update(load_file(path))
        except Exception as error:  # OSError, or safetensors' own SafetensorError for a corrupt file
            name = path.relative_to(checkpoint)
            raise CheckpointError(f"checkpoint {checkpoint} has no readable {name}: {error}") from None
    return weights, state.policy_version
