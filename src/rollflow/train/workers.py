"""Data-parallel trainer workers: ``trainer.num_workers`` processes in one torch.distributed group.

Each worker is a spawned process (like ``TrainerProcess``'s child) that joins the group (gloo on CPU; NCCL
for CUDA tensors, one GPU per worker) and builds the model per ``trainer.parallelism``: ``fsdp2``
(``fully_shard`` per decoder layer and the root, see ``rollflow.train.distributed``; only rank 0 reads the
weights, the others start on the meta device and receive their shards) or ``ddp`` (a whole replica per
worker, gradients summed once per step). It then serves the same calls as a ``Trainer``, each on its own
share of the step: ``TrainerWorkers`` sends rank ``r`` the ``r``-th ``RankBatch`` of a ``PackedBatch`` and
returns rank 0's result, whose metrics are already the whole step's (all-reduced).

Rank 0 creates the group's rendezvous store on a free port of its own host and tells the parent, which
passes it on to the other ranks. A worker that dies ends the call in progress with an error naming its rank;
the others are stopped with it (they would wait for it in their next collective), so no process is left
behind. A worker also exits when the parent does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import structlog

from rollflow.errors import ConfigError, RollflowError
from rollflow.processes import start_function, stop_functions
from rollflow.train.handle import RankGroup
from rollflow.train.process import STARTUP_TIMEOUT_S, TrainerSpec
from rollflow.train.serving import serve_trainer_calls

log = structlog.get_logger(__name__)

HOST = "127.0.0.1"
"""Local workers rendezvous on loopback."""
CLOSE_TIMEOUT_S = 10.0
ERROR_GRACE_S = 10.0
"""After one worker raised, how long the others may take to answer before they are taken as stuck in a
collective the failed rank never joins (and the group is stopped)."""
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""Longest a worker waits in one collective for the others (then it fails instead of hanging)."""


class TrainerWorkerError(RollflowError):
    """A trainer worker did not start, died, or the group was stopped after a failure."""


@dataclass
class _Worker:
    rank: int
    process: Any  # multiprocessing.Process
    conn: Connection


class TrainerWorkers(RankGroup):
    """``spec.config.num_workers`` data-parallel trainer processes behind one handle (``TrainerHandle``).

    Calls block and are serialized; run them from a worker thread. ``close`` stops every worker.

    Raises (from the constructor, before any process starts):
        ConfigError: more workers than GPUs when training on CUDA.
    Raises (from the constructor, after):
        TrainerWorkerError: a worker exited or the group was not ready within ``STARTUP_TIMEOUT_S``.
        Exception: what building the trainer raised in a worker (e.g. a model that does not load).
    """

    def __init__(self, spec: TrainerSpec):
        config = spec.config
        self.world_size = config.num_workers
        self.parallelism = config.parallelism
        device = _check_devices(config)
        # Unset: the process's torch count (the cores, or OMP_NUM_THREADS where set) shared among the workers.
        threads = config.num_threads or max(1, _torch_threads() // self.world_size)
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._workers: list[_Worker] = []
        try:
            for rank in range(self.world_size):
                conn, child_conn = multiprocessing.Pipe()
                process = start_function(
                    _serve_rank,
                    (child_conn, spec, rank, self.world_size, device, threads),
                    name=f"rollflow-trainer-{rank}",
                )
                child_conn.close()
                self._workers.append(_Worker(rank, process, conn))
            (port,) = self._gather("start", ranks=[0], timeout=STARTUP_TIMEOUT_S)
            for worker in self._workers[1:]:
                worker.conn.send(("rendezvous", port))
            self._gather("start", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self._stop()
            raise
        log.debug(
            "trainer workers ready", pids=self.pids, parallelism=self.parallelism, device=device, port=port
        )

    @property
    def pids(self) -> list[int | None]:
        """Worker process ids, in rank order."""
        return [worker.process.pid for worker in self._workers]

    def close(self) -> None:
        """Ask every worker to exit; kill those that do not within ``CLOSE_TIMEOUT_S``. Idempotent."""
        with self._lock:
            for worker in self._workers:
                if worker.process.exitcode is None:
                    with contextlib.suppress(OSError, ValueError):
                        worker.conn.send(("close",))
            stop_functions([worker.process for worker in self._workers], CLOSE_TIMEOUT_S)
            self._stop()

    # ---------------------------------------------------------------- calls

    def _call(
        self, method: str, args: tuple[Any, ...] = (), per_rank: list[tuple[Any, ...]] | None = None
    ) -> list[Any]:
        """Send ``method`` to every rank (``per_rank[r]`` as rank r's arguments, else ``args``) and gather
        the answers in rank order."""
        with self._lock:
            if self._failure is not None:
                raise TrainerWorkerError(f"the trainer workers were stopped: {self._failure}")
            for worker in self._workers:
                rank_args = args if per_rank is None else per_rank[worker.rank]
                with contextlib.suppress(OSError, ValueError):  # it died: the gather below names it
                    worker.conn.send((method, *rank_args))
            return self._gather(method)

    def _gather(self, method: str, ranks: list[int] | None = None, timeout: float | None = None) -> list[Any]:
        """The answer of each of ``ranks`` (default: all). A rank that died, or an error raised in one,
        ends the call; ranks then stuck (in a collective the failed one never joins) stop the group."""
        pending = {
            rank: self._workers[rank] for rank in (ranks if ranks is not None else range(self.world_size))
        }
        values: dict[int, Any] = {}
        errors: dict[int, tuple[BaseException, str]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready = wait(
                [w.conn for w in pending.values()] + [w.process.sentinel for w in pending.values()], remaining
            )
            if not ready:
                if errors:
                    break  # the others are stuck waiting for the failed rank
                self._fail(f"ranks {sorted(pending)} did not answer {method} within {timeout:.0f} s")
                raise TrainerWorkerError(f"trainer workers {sorted(pending)} did not answer {method} in time")
            for rank, worker in list(pending.items()):
                if worker.conn in ready or worker.conn.poll():
                    try:
                        status, value, child_traceback = worker.conn.recv()
                    except (EOFError, OSError):
                        self._raise_exited(worker, method)
                    del pending[rank]
                    if status == "error":
                        errors[rank] = (value, child_traceback)
                        deadline = time.monotonic() + ERROR_GRACE_S
                    else:
                        values[rank] = value
                elif worker.process.sentinel in ready:
                    self._raise_exited(worker, method)
        if errors:
            rank = min(errors)
            error, child_traceback = errors[rank]
            if pending:
                self._fail(f"rank {rank} raised {type(error).__name__} during {method}")
            error.add_note(f"raised in trainer worker rank {rank}:\n{child_traceback}")
            raise error
        return [values[rank] for rank in sorted(values)]

    def _raise_exited(self, worker: _Worker, method: str) -> None:
        worker.process.join(1.0)
        message = (
            f"trainer worker rank {worker.rank} (pid {worker.process.pid}) exited (exit code "
            f"{worker.process.exitcode}) during {method}; the other workers were stopped. Its error, if it "
            "printed one, is above in this log"
        )
        if method == "start":
            message += (
                ' (a script that starts workers must guard its entry point with `if __name__ == "__main__":`,'
                " since they re-import it)"
            )
        self._fail(message)
        raise TrainerWorkerError(message)

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._stop()

    def _stop(self) -> None:
        """Kill every worker still running and reap them all."""
        stop_functions([worker.process for worker in self._workers], 0.0)
        for worker in self._workers:
            worker.conn.close()


def _check_devices(config: Any) -> str:
    """``cpu`` or ``cuda`` for the workers; the worker count checked against the devices."""
    import torch

    setting = getattr(config, "device", "cpu")
    cuda = setting == "cuda" or (setting == "auto" and torch.cuda.is_available())
    count = config.num_workers
    if cuda:
        gpus = torch.cuda.device_count()
        if count > gpus:
            raise ConfigError(
                f"trainer.num_workers = {count} needs one GPU per worker, but {gpus} are visible; set "
                f"trainer.num_workers <= {gpus} (or CUDA_VISIBLE_DEVICES)"
            )
        return "cuda"
    cores = os.cpu_count() or 1
    if count > cores:
        log.warning(
            "more trainer workers than CPU cores: they will contend for them",
            num_workers=count,
            cpu_count=cores,
        )
    return "cpu"


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# -------------------------------------------------------------------- the worker process


def _serve_rank(
    conn: Connection, spec: TrainerSpec, rank: int, world_size: int, device: str, threads: int
) -> None:
    serve_trainer_calls(
        conn,
        lambda: _start_rank(conn, spec, rank, world_size, device, threads),
        run_call,
        stand_in=TrainerWorkerError,
        on_close=_leave_now,
    )


def _leave_now() -> None:
    leave_group()
    # Nothing is left to flush but the standard streams; the interpreter's own teardown (torch's and
    # transformers' modules) would take seconds on a busy machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_rank(conn: Connection, spec: TrainerSpec, rank: int, world_size: int, device: str, threads: int):
    if rank == 0:
        store = open_store(HOST, 0, world_size, is_master=True)
        conn.send(("ok", store.port, ""))
    else:
        _, port = conn.recv()
        store = open_store(HOST, port, world_size, is_master=False)
    return build_rank(spec, rank, world_size, device, threads, store, cuda_index=rank)


def open_store(host: str, port: int, world_size: int, is_master: bool) -> Any:
    """The group's rendezvous store: rank 0 hosts it (port 0: the OS picks a free port, with no window for
    another process to take it; ``store.port`` tells which), the others connect to ``host:port``."""
    import torch.distributed as dist

    if is_master:
        return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False)
    return dist.TCPStore(host, port, world_size, is_master=False)


def build_rank(
    spec: TrainerSpec, rank: int, world_size: int, device: str, threads: int, store: Any, cuda_index: int
) -> Any:
    """Join the torch.distributed group through ``store`` and build this rank's ``Trainer`` (on CUDA device
    ``cuda_index`` when ``device`` is ``cuda``). Shared by local worker processes and Ray actors.

    With a KL penalty (``trainer.kl_coef > 0``) the rank also holds the reference policy, loaded from the same
    initial weights and built the same way as the policy (sharded under ``fsdp2``, a whole replica under
    ``ddp``), frozen: no gradients, no optimizer state, never part of a checkpoint."""
    import torch
    import torch.distributed as dist

    from rollflow.models.loading import load_causal_lm
    from rollflow.train.distributed import DataParallel
    from rollflow.train.trainer import Trainer

    torch.set_num_threads(threads)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(cuda_index)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    target = torch.device(f"cuda:{cuda_index}" if device == "cuda" else "cpu")

    lora = spec.config.lora

    def load(adapter: bool) -> Any:
        if spec.config.parallelism == "fsdp2":
            return _load_sharded_model(
                spec.model_dir,
                rank,
                target,
                _compute_dtype(spec.config, device),
                lora=lora if adapter else None,
                seed=spec.seed,
            )
        model = load_causal_lm(spec.model_dir)
        if adapter and lora is not None:
            from rollflow.train.lora import apply_lora

            model = apply_lora(model, lora, seed=spec.seed)  # seeded: every replica starts the same adapter
        return model.to(target)

    model = load(adapter=True)
    # With LoRA the reference is the base under the adapter (switched off): no second model.
    reference = load(adapter=False) if spec.config.kl_coef > 0 and lora is None else None
    trainer = Trainer(model, **spec.trainer_kwargs(), reference_model=reference)
    trainer.parallel = DataParallel(spec.config.parallelism)
    return trainer


def _load_sharded_model(
    model_dir: Path, rank: int, target: Any, param_dtype: Any, lora: Any = None, seed: int = 0
) -> Any:
    """The model, sharded, with only rank 0 reading the weights: the others build it on the meta device
    (no memory), shard it, and receive their shards from rank 0's full state dict. With ``lora`` the adapter
    goes in before sharding (rank 0's initial adapter reaches the others with the weights)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollflow.models.loading import load_causal_lm
    from rollflow.train.distributed import shard_model

    if rank == 0:
        model = load_causal_lm(model_dir).to(target)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_dir), dtype=torch.float32
            )
        model.eval()  # as load_causal_lm's: no dropout
        full = {}
    if lora is not None:
        from rollflow.train.lora import apply_lora

        apply_lora(model, lora, seed=seed)
        if rank == 0:
            full = model.state_dict()
    shard_model(model, param_dtype=param_dtype)
    if rank != 0:
        model.to_empty(device=target)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    # Buffers left out of state dicts (rotary inv_freq) were never initialised off rank 0: take rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model


def _compute_dtype(config: Any, device: str) -> Any:
    """The FSDP2 compute dtype: bfloat16 when ``trainer.dtype`` asks for it (``auto``: on CUDA), else the
    parameters' own (None)."""
    import torch

    dtype = getattr(config, "dtype", "float32")
    if dtype == "bfloat16" or (dtype == "auto" and device == "cuda"):
        return torch.bfloat16
    return None


def run_call(trainer: Any, method: str, args: list[Any]) -> Any:
    """One handle call on this rank's trainer."""
    if method == "train_step":
        return trainer.train_step(*args)
    if method == "full_weights":
        return _full_weights(trainer)
    if method == "push_weights":
        return trainer.push_weights(args[0])
    if method == "probe_logprobs":
        return trainer.probe_logprobs(*args)
    if method in ("save_checkpoint", "load_checkpoint"):
        from rollflow.train import sharded

        return getattr(sharded, method)(trainer, Path(args[0]))
    raise ValueError(f"unknown trainer worker call {method!r}")


def _full_weights(trainer: Any) -> list[tuple[str, Any]] | None:
    """Every rank joins each tensor's gather; rank 0 keeps CPU copies to send."""
    keep = trainer.parallel.rank == 0
    weights = []
    for name, tensor in trainer.named_weights():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if keep:
            weights.append((name, full.detach().to("cpu", copy=True)))
    return weights if keep else None


def leave_group() -> None:
    """Destroy this process's torch.distributed group, if any."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
