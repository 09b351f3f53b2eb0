"""The weight payloads: ``init_info`` and ``update_info`` as msgspec Structs, one per receiver backend.

``init_info`` is a tagged union on ``backend`` (``GlooInit``, ``NcclInit``, ``CheckpointInit``, ``IpcInit``);
``update_info`` is the Struct of the receiver the init built (``TensorsUpdate`` for a broadcast,
``CheckpointUpdate``, ``IpcUpdate``). Each has ``encode_for(engine)``, the exact JSON object a server of that
kind gets:

- ``engine="torch"`` (``rollflow serve``): every field, ``backend`` included;
- ``engine="vllm"``: vLLM 0.33's keys only (``NCCLWeightTransferInitInfo``, ``IPCWeightTransferInitInfo`` and
  their update infos reject unknown keys), so no ``backend``, ``group_name``, ``timeout_s`` or
  ``policy_version``; the checkpoint and gloo payloads go to rollflow's plugin engine
  (``rollflow.vllm_plugin``) and carry its keys.

**The policy version** travels one way: ``/finish_weight_update``'s ``weight_version``
(``ControlPlane.finish_weight_update``). An update for rollflow's servers repeats it as
``policy_version``, only so a server can refuse an older version before loading; vLLM's carries none.

The engine server decodes the same Structs (``decode_init_info``, ``decode_update_info``), accepting vLLM's
shapes too: an ``init_info`` without ``backend`` but with a rendezvous (``master_address``) is a broadcast over
the server's default backend; ``{"packed": …}`` alone is ``ipc``. Unknown keys are ignored (a vLLM-shaped
payload has ``packed_num_buffers``); a bad field is an ``InvalidTransferInfoError`` (a 400) naming it.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from rollflow.errors import InvalidTransferInfoError
from rollflow.weights.ranks import FIRST_WORKER_RANK

#: The kinds of server a payload is encoded for (``inference.engine``).
Engine = Literal["torch", "vllm"]
ENGINES: tuple[str, ...] = ("torch", "vllm")

#: The receiver backends an ``init_info["backend"]`` may name.
RECEIVER_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "checkpoint", "ipc")

#: ``init_info.timeout_s`` when it has none (vLLM's payloads have none).
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_BUCKET_SIZE_BYTES = 256 * 2**20
DEFAULT_IPC_BUCKET_SIZE_BYTES = 512 * 2**20
DEFAULT_GROUP_NAME = "rollflow-weights"
#: Buffers vLLM's packed broadcast keeps in flight (its ``packed_num_buffers``).
VLLM_PACKED_NUM_BUFFERS = 2

#: The keys of vLLM 0.33's ``NCCLWeightTransferInitInfo`` (one rendezvous form), in its order.
VLLM_NCCL_INIT_KEYS: tuple[str, ...] = (
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
)
#: The keys of a gloo ``init_info`` for rollflow's vLLM plugin engine (``rollflow.vllm_plugin.engine``).
ROLLFLOW_ENGINE_GLOO_INIT_KEYS: tuple[str, ...] = (
    "backend",
    "timeout_s",
    "master_address",
    "master_port",
    "world_size",
    "rank_offset",
    "packed",
    "packed_buffer_size_bytes",
    "group_name",
)
#: The keys of vLLM 0.33's NCCL update info.
VLLM_NCCL_UPDATE_KEYS: tuple[str, ...] = ("names", "dtype_names", "shapes")
#: The keys of vLLM 0.33's packed IPC update info.
VLLM_IPC_UPDATE_KEYS: tuple[str, ...] = (*VLLM_NCCL_UPDATE_KEYS, "tensor_sizes", "ipc_handles_pickled")


def check_engine(engine: str) -> Engine:
    """``engine`` when it is one of ``ENGINES``.

    Raises:
        ValueError: naming the choices.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    return engine  # type: ignore[return-value]


class Payload(msgspec.Struct, kw_only=True):
    """What every weight payload offers: its wire form for a kind of server."""

    #: The keys a vLLM server accepts, in order; None: this payload cannot go to vLLM.
    vllm_keys: ClassVar[tuple[str, ...] | None] = None
    #: How error messages name the payload ("broadcast init_info").
    what: ClassVar[str] = "weight payload"

    def encode_for(self, engine: Engine) -> dict[str, Any]:
        """The JSON object a server of kind ``engine`` gets (see the module docstring).

        Raises:
            ValueError: vLLM servers have no receiver for this payload.
        """
        wire = msgspec.to_builtins(self)
        if check_engine(engine) == "torch":
            return {key: value for key, value in wire.items() if key not in self._vllm_only()}
        if self.vllm_keys is None:
            raise ValueError(f"vLLM servers take no {self.what}; use rollflow's own servers for it")
        return {key: wire[key] for key in self.vllm_keys if wire.get(key) is not None}

    @classmethod
    def _vllm_only(cls) -> frozenset[str]:
        """Fields only vLLM's view carries (rollflow's receivers do not use them)."""
        return frozenset()


# ---------------------------------------------------------------- init_info


class InitInfo(Payload, kw_only=True, tag_field="backend"):
    """``/init_weight_transfer_engine``'s ``init_info``: which receiver to build, and how."""

    #: Seconds the receiver's initialization and each of its updates may take.
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def backend(self) -> str:
        """The receiver backend this payload selects (its tag)."""
        return self.__struct_config__.tag  # type: ignore[return-value]


class BroadcastInit(InitInfo, kw_only=True):
    """A broadcast group's rendezvous: trainer rank 0 plus every inference worker (``GlooInit``,
    ``NcclInit``). Each worker joins as rank ``rank_offset + worker_rank``."""

    vllm_keys = VLLM_NCCL_INIT_KEYS
    what = "broadcast init_info"

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = FIRST_WORKER_RANK
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    # The store prefix of this connection: two transfers never share a group.
    group_name: str = DEFAULT_GROUP_NAME
    # vLLM's view only: the buffers its packed broadcast keeps in flight.
    packed_num_buffers: int = VLLM_PACKED_NUM_BUFFERS

    @classmethod
    def _vllm_only(cls) -> frozenset[str]:
        return frozenset({"packed_num_buffers"})


class GlooInit(BroadcastInit, kw_only=True, tag="gloo"):
    """A broadcast over gloo (CPU). vLLM servers join one through rollflow's plugin engine
    (``rollflow.vllm_plugin``, ``--weight-transfer-config '{"backend": "rollflow"}'``), whose init info takes
    this payload's own keys but ``packed_num_buffers``."""

    vllm_keys = ROLLFLOW_ENGINE_GLOO_INIT_KEYS
    what = "gloo broadcast init_info"


class NcclInit(BroadcastInit, kw_only=True, tag="nccl"):
    """A broadcast over NCCL (GPU); its vLLM view is ``NCCLWeightTransferInitInfo``."""


class CheckpointInit(InitInfo, kw_only=True, tag="checkpoint"):
    """Each update names a safetensors file (a path, or a URL of the trainer's endpoint). vLLM's view is the
    init info of rollflow's plugin engine (``rollflow.vllm_plugin``): ``{"timeout_s"}``; vLLM picks the engine
    from ``--weight-transfer-config``, so no ``backend``."""

    vllm_keys = ("timeout_s",)
    what = "checkpoint init_info"


class IpcInit(InitInfo, kw_only=True, tag="ipc"):
    """Colocated GPU: each update carries CUDA IPC handles of packed buffers. vLLM's view is
    ``IPCWeightTransferInitInfo``: ``{"packed": true}``."""

    vllm_keys = ("packed",)
    what = "ipc init_info"

    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_IPC_BUCKET_SIZE_BYTES


AnyInitInfo = GlooInit | NcclInit | CheckpointInit | IpcInit


def decode_init_info(init_info: Any, default_backend: Callable[[], str]) -> AnyInitInfo:
    """The Struct of a server's ``init_info`` (rollflow's shape, or vLLM's: see the module docstring).
    ``default_backend()`` is the server's broadcast backend for a vLLM-shaped rendezvous.

    Raises:
        InvalidTransferInfoError: not a JSON object, an unknown ``backend``, or a missing or bad field (named).
    """
    if not isinstance(init_info, Mapping):
        raise InvalidTransferInfoError(f"init_info must be a JSON object, got {type(init_info).__name__}")
    backend = init_info.get("backend")
    if backend is None and "master_address" in init_info:
        backend = default_backend()
    elif backend is None and set(init_info) == {"packed"}:
        backend = "ipc"
    if backend not in RECEIVER_BACKENDS:
        raise InvalidTransferInfoError(
            f"init_info.backend is {backend!r}; expected one of {', '.join(map(repr, RECEIVER_BACKENDS))}"
        )
    kind = {"gloo": "broadcast", "nccl": "broadcast"}.get(backend, backend)
    try:
        return msgspec.convert({**init_info, "backend": backend}, AnyInitInfo, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidTransferInfoError(f"{kind} init_info is missing or has a bad field: {exc}") from None


# ---------------------------------------------------------------- update_info


class TensorsUpdate(Payload, kw_only=True):
    """A broadcast's ``update_info``: the tensors' metadata (the bytes travel through the group). All-empty
    lists reuse the previous update's."""

    vllm_keys = VLLM_NCCL_UPDATE_KEYS
    what = "broadcast update_info"

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # rollflow's servers only: refuse an older version before loading (see the module docstring).
    policy_version: int | None = None

    def encode_for(self, engine: Engine) -> dict[str, Any]:
        wire = super().encode_for(engine)
        if wire.get("policy_version", 0) is None:
            del wire["policy_version"]
        return wire


class IpcUpdate(TensorsUpdate, kw_only=True):
    """A ``cuda_ipc`` bucket: its tensors' metadata, byte sizes, and the pickled ``{gpu_uuid: handle}``
    (base64) of the buffer holding them."""

    vllm_keys = VLLM_IPC_UPDATE_KEYS
    what = "ipc update_info"

    tensor_sizes: list[int] = []
    # None only on a malformed payload: the receiver says what is missing.
    ipc_handles_pickled: str | None = None


class CheckpointUpdate(Payload, kw_only=True):
    """A ``checkpoint`` update: the file to load, by ``path`` (a shared directory) or ``url``. vLLM's view (the
    plugin engine's update info) has the same keys."""

    vllm_keys = ("path", "url", "policy_version")
    what = "checkpoint update_info"

    path: str | None = None
    url: str | None = None
    policy_version: int | None = None

    def encode_for(self, engine: Engine) -> dict[str, Any]:
        wire = super().encode_for(engine)
        return {key: value for key, value in wire.items() if value is not None}


UpdateInfo = TypeVar("UpdateInfo", TensorsUpdate, IpcUpdate, CheckpointUpdate)


def decode_update_info(update_info: Any, kind: type[UpdateInfo]) -> UpdateInfo:
    """The ``kind`` Struct of one ``update_info`` (the receiver's kind, set by its init).

    Raises:
        InvalidTransferInfoError: not a JSON object, or a missing or bad field (named).
    """
    if not isinstance(update_info, Mapping):
        raise InvalidTransferInfoError(f"update_info must be a JSON object, got {type(update_info).__name__}")
    try:
        return msgspec.convert(update_info, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidTransferInfoError(f"{kind.what} is missing or has a bad field: {exc}") from None
