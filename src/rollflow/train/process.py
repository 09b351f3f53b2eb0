"""The trainer in a process of its own (``trainer.placement = "process"``).

A training step run in a thread of the orchestrator's process shares the interpreter lock with the event
loop, which parses replies, renders prompts and scores samples while the step runs. In the overlapped
modes that costs the step a fifth of its speed on a small model (each lock hand-over waits for the loop's
Python to yield). In a child process the step has an interpreter of its own.

The child builds the same ``Trainer`` the thread placement would (same model files, config and seed, so the
same updates). Weights leave it by ``push_weights``: the weight transfer's transport half runs in the child,
which sends them to the inference servers itself (broadcast, checkpoint, CUDA IPC), so the parent never holds
them. Only in-process engines (the ``local`` strategy) need them here: the first ``named_weights`` call moves
the child's weights to shared memory and maps them, live and without a copy. Batches, transport calls and
results travel pickled over a pipe; an exception raised in the child is raised again in the parent, with the
child's traceback attached as a note.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog

from rollflow.config import OffPolicyTable, TrainerConfig
from rollflow.errors import RollflowError
from rollflow.messages import PackedBatch, StepResult
from rollflow.processes import start_function, stop_functions
from rollflow.train.serving import serve_trainer_calls

log = structlog.get_logger(__name__)

STARTUP_TIMEOUT_S = 300.0
"""Importing torch and transformers and loading the model; a child slower than this is taken as hung."""
CLOSE_TIMEOUT_S = 10.0


class TrainerProcessError(RollflowError):
    """The trainer process did not start, or exited while a call was waiting for it."""


@dataclass(frozen=True)
class TrainerSpec:
    """What the child needs to build its ``Trainer`` (picklable; see ``Trainer`` for the fields)."""

    model_dir: Path
    config: TrainerConfig
    temperature: float
    pad_token_id: int
    seed: int
    off_policy: str | OffPolicyTable  # a name or the resolved table (``Trainer``'s ``off_policy``)
    total_steps: int | None = None

    def trainer_kwargs(self) -> dict[str, Any]:
        """``Trainer``'s arguments after the model."""
        return {
            "config": self.config,
            "temperature": self.temperature,
            "pad_token_id": self.pad_token_id,
            "seed": self.seed,
            "off_policy": self.off_policy,
            "total_steps": self.total_steps,
        }


class TrainerProcess:
    """A ``Trainer`` served by a child process, with the methods the orchestrator calls.

    Calls are blocking and serialized (run them from a worker thread, like ``Trainer``'s); ``close`` stops
    the child. The child also exits on its own when the parent's end of the pipe closes. It ignores SIGINT
    and SIGTERM, which a terminal, ``timeout`` or a batch system send to the whole process group: the parent
    handles them (a step or checkpoint in progress finishes) and then closes the child.

    Raises (from the constructor):
        TrainerProcessError: the child exited or did not report ready within ``STARTUP_TIMEOUT_S``.
        Exception: what building the trainer raised in the child (e.g. a model that does not load).
    """

    def __init__(self, spec: TrainerSpec):
        self._conn, child_conn = multiprocessing.Pipe()
        self._process = start_function(_serve, (child_conn, spec), name="rollflow-trainer")
        child_conn.close()
        self._lock = threading.Lock()
        # Before multiprocessing's own exit handler (atexit runs last-registered first), which would
        # SIGTERM the child (ignored) and wait for it forever if this object was never closed.
        atexit.register(self.close)
        self._weights: dict[str, Any] | None = None
        try:
            self._receive("start", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        log.debug("trainer process ready", pid=self._process.pid)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    world_size = 1
    """Data-parallel ranks the trainer's batches are packed for."""

    def train_step(self, batch: PackedBatch, policy_version: int | None = None) -> StepResult:
        """``Trainer.train_step`` in the child."""
        return self._call("train_step", batch, policy_version)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The child's live weights (shared memory, no copy): ``Trainer.named_weights``'s names and order.
        The first call moves them to shared memory."""
        if self._weights is None:
            self._weights = self._call("share_weights")
        yield from self._weights.items()

    def push_weights(self, call: Any) -> Any:
        """``Trainer.push_weights`` in the child: ``call`` (a picklable ``rollflow.weights.TransportCall``) runs
        there on the child's weights; returns its result."""
        return self._call("push_weights", call)

    def probe_logprobs(self, token_ids: Sequence[int], start: int = 1) -> list[float]:
        """``Trainer.probe_logprobs`` in the child."""
        return self._call("probe_logprobs", list(token_ids), start)

    def save_checkpoint(self, directory: str | Path) -> None:
        """``Trainer.save_checkpoint`` in the child."""
        self._call("save_checkpoint", str(directory))

    def load_checkpoint(self, directory: str | Path) -> None:
        """``Trainer.load_checkpoint`` in the child (in place: ``named_weights`` then shows the loaded ones)."""
        self._call("load_checkpoint", str(directory))

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not within ``CLOSE_TIMEOUT_S``. Idempotent."""
        if self._process.exitcode is None and self._process.pid is not None:
            with contextlib.suppress(OSError, ValueError):  # the child is already gone
                self._conn.send(("close",))
            stop_functions([self._process], CLOSE_TIMEOUT_S)
        self._conn.close()
        atexit.unregister(self.close)

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((method, *args))
            except (OSError, ValueError) as error:
                raise self._exited(method) from error
            return self._receive(method)

    def _receive(self, method: str, timeout: float | None = None) -> Any:
        if timeout is not None and not self._conn.poll(timeout):
            raise TrainerProcessError(f"the trainer process did not answer {method} within {timeout:.0f} s")
        try:
            status, value, child_traceback = self._conn.recv()
        except (EOFError, OSError) as error:
            raise self._exited(method) from error
        if status == "error":
            value.add_note(f"raised in the trainer process:\n{child_traceback}")
            raise value
        return value

    def _exited(self, method: str) -> TrainerProcessError:
        self._process.join(1.0)
        hint = (
            ' (a script that starts it must guard its entry point with `if __name__ == "__main__":`, '
            "since the child re-imports the script)"
            if method == "start"
            else ""
        )
        return TrainerProcessError(
            f"the trainer process exited (exit code {self._process.exitcode}) during {method}; "
            f"its error, if it printed one, is above in this log{hint}"
        )


def _serve(conn: Connection, spec: TrainerSpec) -> None:
    """The child: build the trainer, then run calls until ``close`` or the pipe closes."""
    serve_trainer_calls(conn, lambda: _build(spec), _answer, stand_in=TrainerProcessError)


def _build(spec: TrainerSpec) -> Any:
    from rollflow.models.loading import load_causal_lm
    from rollflow.train.trainer import Trainer

    return Trainer(load_causal_lm(spec.model_dir), **spec.trainer_kwargs())


def _answer(trainer: Any, method: str, args: list[Any]) -> Any:
    if method == "share_weights":
        trainer.model.share_memory()  # in place: the optimizer keeps the same parameters
        return dict(trainer.named_weights())
    return getattr(trainer, method)(*args)
