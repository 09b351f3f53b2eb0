"""The control plane of inference engines: pause, sleep, world size and the weight-update lifecycle.

Every data-plane client exposes one as ``client.control`` (a ``ControlPlane``): ``RemoteInferenceClient``'s fans
each call out to every server URL (``rollflow.inference.remote_control.HttpControlPlane``); ``LocalInferenceClient``'s
drives its in-process engines (``InProcessControlPlane``). The weight barrier, colocation and the weight
strategies (``rollflow.weights``) talk only to this protocol.

A weight update follows vLLM 0.33's lifecycle: ``init_weight_transfer`` once per connection (one wire payload
per server, ranks already assigned by ``rollflow.weights.ranks``), then per policy version
``start_weight_update`` ▸ ``update_weights`` (one or more) ▸ ``finish_weight_update(policy_version)``.

**How the policy version travels.** It has one source: the ``policy_version`` given to
``finish_weight_update``, which labels the servers' weights (the wire's ``weight_version``) and, on the HTTP
plane, becomes the version the data-plane client stamps on later tokens when a server reports none. Payload
encodings may repeat that same number (rollflow's own servers read ``update_info.policy_version`` to refuse an
older version before loading, ``rollflow.weights.payloads``); nothing else sets it.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from rollflow.inference.engine.engine import TorchEngine

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")

#: One JSON payload as a server receives it (``init_info`` or ``update_info``), already encoded for its kind
#: of server (``rollflow.weights.payloads``).
WirePayload = Mapping[str, object]


class WorldSize(msgspec.Struct, frozen=True):
    """The inference workers a weight transfer must reach, as the servers report them.

    ``total_workers`` is what a broadcast group counts besides the trainer; each server reports
    ``workers_per_server`` (TP·PP·DP of its deployment). A vLLM data-parallel deployment runs one HTTP server
    per DP rank, each reporting the whole deployment, so ``total_workers = workers_per_server × num_servers //
    data_parallel_size``.
    """

    total_workers: int
    workers_per_server: int
    num_servers: int
    # Server URLs per deployment that each report the deployment's whole world size (vLLM DP); 1 otherwise.
    data_parallel_size: int = 1
    # Base URL of each server, in fan-out order; empty for in-process engines (named in error messages).
    server_urls: tuple[str, ...] = ()

    @property
    def num_deployments(self) -> int:
        """Deployments the servers form (each ``data_parallel_size`` servers are one)."""
        return self.num_servers // self.data_parallel_size


@runtime_checkable
class ControlPlane(Protocol):
    """Control of every engine behind one data-plane client (see the module docstring).

    Every method raises ``rollflow.errors.ControlPlaneError`` (naming each server that failed) on the HTTP
    plane; the in-process plane raises what the engines raise.
    """

    @property
    def server_urls(self) -> Sequence[str]:
        """The servers the calls reach now (a dropped server is gone); empty for in-process engines."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating; in-flight requests as ``mode`` says (``InferenceClient.pause``)."""
        ...

    async def resume(self) -> None:
        """Continue generating after ``pause``."""
        ...

    async def sleep(
        self, level: int = 1, tags: Sequence[str] | None = None, mode: PauseMode | None = None
    ) -> None:
        """Free memory for a colocated trainer: 0 pauses scheduling, 1 frees the KV cache, 2 the weights too;
        running requests are handled by ``mode`` first (``abort`` when None)."""
        ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` freed: ``weights``, ``kv_cache`` (none: everything)."""
        ...

    async def world_size(self) -> WorldSize:
        """The workers a weight transfer must reach, asked from the engines (never taken from config)."""
        ...

    async def init_weight_transfer(self, init_infos: Sequence[WirePayload]) -> None:
        """``/init_weight_transfer_engine`` with ``init_infos[i]`` to server ``i`` (one entry: the same for
        every server). For a process group this blocks until the trainer joined: run it with the trainer side.

        Raises:
            ValueError: neither one entry nor one per server.
        """
        ...

    async def start_weight_update(self) -> None:
        """``/start_weight_update`` on every server."""
        ...

    async def update_weights(self, update_info: WirePayload | Sequence[WirePayload]) -> None:
        """``/update_weights`` with ``update_info`` on every server (vLLM's list form: one entry per global
        worker rank). For a broadcast this blocks until the trainer has sent: run it with the trainer side."""
        ...

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        """``/finish_weight_update``: the servers label their weights ``policy_version`` (the one way the
        version travels; see the module docstring)."""
        ...

    async def weight_versions(self) -> dict[str, str | None]:
        """``/weight_info``: the ``weight_version`` each server labels its weights with, by URL (None: none
        yet), to check that an update took."""
        ...

    async def weight_checksums(self) -> dict[str, dict[str, set[str]]]:
        """SHA-256 digests of the parameters each server holds, by URL and parameter name (empty for a server
        that cannot say), to check that an update took (``rollflow.weights.delivery``)."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Every server loads the PEFT adapter directory ``path`` as LoRA adapter ``name`` (vLLM's
        ``/v1/load_lora_adapter``)."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Every server drops LoRA adapter ``name``."""
        ...

    async def lora_adapters(self) -> dict[str, dict[str, str | None]]:
        """The LoRA adapters each server serves, by URL: ``{name: the directory it was loaded from}``."""
        ...

    async def sample_logprobs(
        self, model: str, prompt: Sequence[int], max_tokens: int, seed: int = 0
    ) -> dict[str, tuple[list[int], list[float]]]:
        """Each server's ``max_tokens`` tokens sampled after ``prompt`` by ``model`` (a LoRA adapter's name, or
        the base model's) at temperature 1 with ``seed``, and the logprob of each: ``{url: (ids, logprobs)}``."""
        ...

    def serve_adapter(self, name: str | None, policy_version: int) -> None:
        """Requests started from now on are served by LoRA adapter ``name`` (None: the base model) and their
        tokens carry ``policy_version``."""
        ...

    async def finish_session(self, session_id: str | None) -> None:
        """Tell the router that ``session_id`` is done (best effort, never raises)."""
        ...


class InProcessControlPlane:
    """The control plane of ``TorchEngine``s in this process: every call reaches every engine, in order.

    There are no servers to initialize: weights arrive as tensors through ``load_weights`` (the ``local``
    strategy); the HTTP weight-update calls raise ``TypeError`` naming it.
    """

    def __init__(self, engines: Sequence[TorchEngine]):
        self.engines = list(engines)

    @property
    def server_urls(self) -> Sequence[str]:
        """No servers: the engines are in this process."""
        return ()

    async def pause(self, mode: PauseMode = "abort") -> None:
        for engine in self.engines:
            await engine.pause(mode)

    async def resume(self) -> None:
        for engine in self.engines:
            await engine.resume()

    async def sleep(
        self, level: int = 1, tags: Sequence[str] | None = None, mode: PauseMode | None = None
    ) -> None:
        """Pause by ``mode``; at level 1 or 2 the engines then free memory (``TorchEngine.sleep``) and admit
        nothing until ``wake_up``. ``tags`` are ignored, as by vLLM 0.33."""
        for engine in self.engines:
            await engine.pause(mode or "abort")
            if level > 0:
                await engine.sleep(level)
                await engine.resume()  # sleeping admits nothing until woken, as the servers do

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for engine in self.engines:
            await engine.wake_up(tags or None)
        if not tags or "scheduling" in tags:
            await self.resume()

    async def world_size(self) -> WorldSize:
        count = len(self.engines)
        return WorldSize(total_workers=count, workers_per_server=1, num_servers=count)

    async def load_weights(self, named_tensors: Iterable[tuple[str, object]], policy_version: int) -> None:
        """Load HF-named tensors into every engine; later tokens carry ``policy_version``. Pause first."""
        tensors = list(named_tensors)
        for engine in self.engines:
            await engine.load_weights(tensors, policy_version=policy_version)  # type: ignore[arg-type]

    async def init_weight_transfer(self, init_infos: Sequence[WirePayload]) -> None:
        raise self._no_servers("init_weight_transfer")

    async def start_weight_update(self) -> None:
        raise self._no_servers("start_weight_update")

    async def update_weights(self, update_info: WirePayload | Sequence[WirePayload]) -> None:
        raise self._no_servers("update_weights")

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        raise self._no_servers("finish_weight_update")

    async def weight_versions(self) -> dict[str, str | None]:
        raise self._no_servers("weight_versions")

    async def weight_checksums(self) -> dict[str, dict[str, set[str]]]:
        raise self._no_servers("weight_checksums")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise self._no_servers("load_lora_adapter")

    async def unload_lora_adapter(self, name: str) -> None:
        raise self._no_servers("unload_lora_adapter")

    async def lora_adapters(self) -> dict[str, dict[str, str | None]]:
        raise self._no_servers("lora_adapters")

    async def sample_logprobs(
        self, model: str, prompt: Sequence[int], max_tokens: int, seed: int = 0
    ) -> dict[str, tuple[list[int], list[float]]]:
        raise self._no_servers("sample_logprobs")

    def serve_adapter(self, name: str | None, policy_version: int) -> None:
        raise self._no_servers("serve_adapter")

    async def finish_session(self, session_id: str | None) -> None:
        """Nothing to forget: no router in between."""

    @staticmethod
    def _no_servers(call: str) -> TypeError:
        return TypeError(
            f"{call}: in-process engines have no weight-transfer servers; they take weights as tensors "
            "(weight_sync.strategy = 'local')"
        )
