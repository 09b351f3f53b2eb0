"""``rollflow serve``'s health, metrics and engine-control endpoints (vLLM's names): ``/health``, ``/metrics``,
``/get_control_log``, pause and resume, sleep and wake-up, prefix-cache reset, aborts and the world size.
A mixin of ``EngineServer`` over its state; the weight-transfer endpoints stay in ``server``."""

from __future__ import annotations

import time
from typing import Any

import structlog
from aiohttp import web

from rollflow.inference.client import PAUSE_MODES
from rollflow.inference.engine.server_protocol import (
    AbortBody,
    InferenceAbortBody,
    ResetPrefixCacheBody,
    bad_request,
    engine_dead,
    json_response,
    query_bool,
)

log = structlog.get_logger("rollflow.inference.engine.server")

# What sleep may put to sleep (vLLM's wake_up tags), and the ones that hold memory.
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
MEMORY_TAGS = ("weights", "kv_cache")


class EngineServerAdmin:
    """The health and control endpoints of ``EngineServer``."""

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body while the engine runs (paused or asleep included), as vLLM; 503 with the error
        JSON, ``type`` ``EngineDeadError``, once its loop died (vLLM's 503 for a dead engine)."""
        if self.engine.is_dead:
            raise engine_dead(self.engine.dead_reason)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        engine = self.engine
        label = '{model_name="' + self.served_model_name.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float, labels: str = label) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{'_total' if kind == 'counter' else ''}{labels} {value}")

        metric("vllm:num_requests_running", "gauge", "Requests holding a KV-cache slot.", engine.num_running)
        metric(
            "vllm:num_requests_waiting", "gauge", "Requests waiting for a KV-cache slot.", engine.num_waiting
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV-cache slots in use.",
            engine.num_running / engine.max_batch_size,
        )
        metric(
            "vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
            engine.prefix_cache_query_tokens,
        )  # fmt: skip
        metric(
            "vllm:prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.",
            engine.prefix_cache_hit_tokens,
        )  # fmt: skip
        metric(
            "rollflow:prefix_cache_query_requests", "counter", "Requests looked up in the prefix cache.",
            engine.prefix_cache_queries,
        )  # fmt: skip
        metric(
            "rollflow:prefix_cache_hit_requests", "counter", "Requests that reused a cached prefix.",
            engine.prefix_cache_hits,
        )  # fmt: skip
        metric("vllm:prompt_tokens", "counter", "Prompt tokens processed.", engine.total_prompt_tokens)
        metric("vllm:generation_tokens", "counter", "Tokens generated.", engine.total_generated_tokens)
        metric(
            "vllm:request_success", "counter", "Requests finished.", engine.num_finished_requests
        )  # fmt: skip
        metric(
            "rollflow:policy_version", "gauge", "Policy version of the loaded weights.", engine.policy_version
        )
        metric(
            "rollflow:engine_steps", "counter", "Engine loop iterations (admission and one decode step each).",
            engine.num_steps,
        )  # fmt: skip
        metric(
            "vllm:num_preemptions", "counter",
            "Sequences that gave up their KV-cache slot to a request below its fair share.",
            engine.num_preemptions,
        )  # fmt: skip
        metric(
            "rollflow:request_failures", "counter", "Requests failed inside the engine, which kept serving.",
            engine.num_failed_requests,
        )  # fmt: skip
        metric(
            "rollflow:engine_dead",
            "gauge",
            "1 once the engine loop died (restart the server).",
            int(engine.is_dead),
        )
        for event in ("sleep", "wake_up", "update_weights"):
            metric(
                f"rollflow:{event}_calls", "counter", f"/{event} calls handled (see GET /control_log).",
                self._control_counts[event],
            )  # fmt: skip
        lines.append("# HELP vllm:engine_sleep_state Engine sleep state (1 for the current one).")
        lines.append("# TYPE vllm:engine_sleep_state gauge")
        current = {None: "awake", 0: "awake", 1: "weights_offloaded", 2: "discard_all"}[self.sleep_level]
        for state in ("awake", "weights_offloaded", "discard_all"):
            model_label = label[1:-1]
            lines.append(
                f'vllm:engine_sleep_state{{{model_label},sleep_state="{state}"}} {int(state == current)}'
            )
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def _stop_engine(self, mode: str) -> None:
        await self._engine_call(self.engine.pause(mode))
        if mode == "abort":
            # The engine's abort pause ends running requests; vLLM's also ends those still queued.
            await self._engine_call(self.engine.abort())

    def record(self, event: str, **fields: Any) -> None:
        """Append a control event to ``control_log`` (with the requests finished and tokens generated so far,
        and the loaded policy version) and count it for ``/metrics``."""
        self._control_counts[event] += 1
        self.control_log.append(
            {
                "event": event,
                **fields,
                "requests_finished": self.engine.num_finished_requests,
                "tokens_generated": self.engine.total_generated_tokens,
                "policy_version": self.engine.policy_version,
                "time": time.time(),
            }
        )

    async def get_control_log(self, request: web.Request) -> web.Response:
        """``GET /control_log``: the control calls this server handled, oldest first (``?clear=true`` empties
        the log after reading it)."""
        entries = list(self.control_log)
        if query_bool(request, "clear", False):
            self.control_log.clear()
        return json_response({"entries": entries})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise bad_request(
                f"mode={mode!r} is not a pause mode; use one of {', '.join(PAUSE_MODES)}", "mode"
            )
        clear_cache = query_bool(request, "clear_cache", True)
        async with self._control_lock:
            self.pause_mode = mode  # before waiting: new requests get 503 while running ones drain
            await self._stop_engine(mode)
            if clear_cache and mode != "keep":
                await self._engine_call(self.engine.reset_prefix_cache())
            self.record("pause", mode=mode)
        return json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        async with self._control_lock:
            self.pause_mode = None
            if not self.sleeping_tags:
                await self._engine_call(self.engine.resume())
            self.record("resume")
        return json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.pause_mode is not None or bool(self.sleeping_tags)})

    async def sleep(self, request: web.Request) -> web.Response:
        """``POST /sleep?level=&mode=``: level 0 pauses scheduling; 1 also frees the KV cache (weights kept);
        2 frees the weights too. Running requests are handled by ``mode`` first (``keep`` only at level 0)."""
        raw_level = request.query.get("level", "1")
        try:
            level = int(raw_level)
        except ValueError:
            level = -1
        if level not in (0, 1, 2):
            raise bad_request(f"level={raw_level!r} is not a sleep level; use 0, 1 or 2", "level")
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise bad_request(
                f"mode={mode!r} is not a pause mode; use one of {', '.join(PAUSE_MODES)}", "mode"
            )
        if mode == "keep" and level >= 1:
            raise bad_request(
                f"mode=keep cannot be used with level={level}: that level frees the KV cache, which frozen "
                "requests need to continue; use mode=abort or mode=wait (or level=0)",
                "mode",
            )
        async with self._control_lock:
            self.sleep_mode, self.sleep_level = mode, level
            self.sleeping_tags = {"scheduling"} if level == 0 else {"scheduling", *MEMORY_TAGS}
            await self._stop_engine(mode)
            if level >= 1:
                await self._engine_call(self.engine.sleep(level))
            self.record("sleep", level=level, mode=mode)
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        """``POST /wake_up?tags=…``: restore ``weights`` and/or ``kv_cache`` (none: everything). As in vLLM,
        scheduling resumes once no memory is asleep, whichever tags were asked for."""
        tags = request.query.getall("tags", [])
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise bad_request(f"unknown wake_up tags {unknown}; use {', '.join(SLEEP_TAGS)}", "tags")
        async with self._control_lock:
            if self.sleeping_tags:
                memory = set(tags or MEMORY_TAGS) & set(MEMORY_TAGS) & self.sleeping_tags
                if memory:
                    await self._engine_call(self.engine.wake_up(memory))
                self.sleeping_tags -= memory
                if not self.sleeping_tags & set(MEMORY_TAGS):  # scheduling resumes once all memory is back
                    self.sleeping_tags.clear()
                    self.sleep_mode = self.sleep_level = None
            # Recorded before scheduling resumes: the log's counters then hold nothing generated after it.
            self.record("wake_up", tags=tags or None, awake=not self.sleeping_tags)
            if not self.sleeping_tags and self.pause_mode is None:
                await self._engine_call(self.engine.resume())
        status = "sleeping" if self.sleeping_tags else "awake"
        return json_response({"status": status, "tags": tags or None})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return json_response({"is_sleeping": bool(self.sleeping_tags)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        query_bool(request, "reset_running_requests", False)
        query_bool(request, "reset_external", False)
        await self._read(request, ResetPrefixCacheBody, empty_ok=True)
        success = await self._engine_call(self.engine.reset_prefix_cache())
        return json_response({"success": bool(success)})

    async def abort_requests(self, request: web.Request) -> web.Response:
        """``POST /abort_requests``: abort the listed requests, or every request when no ids are given. Behind
        the API key when one is set; without one, open to whoever reaches the server (on loopback: every
        local user), who can abort everyone's requests."""
        body = await self._read(request, AbortBody, empty_ok=True)
        aborted = await self._engine_call(self.engine.abort(body.request_ids or None))
        return json_response({"status": "aborted", "aborted": aborted})

    async def inference_abort_requests(self, request: web.Request) -> web.Response:
        body = await self._read(request, InferenceAbortBody)
        if body.request_ids:
            await self._engine_call(self.engine.abort(body.request_ids))
        return web.Response(status=200)

    async def get_world_size(self, request: web.Request) -> web.Response:
        query_bool(request, "include_dp", True)
        return json_response({"world_size": 1})
