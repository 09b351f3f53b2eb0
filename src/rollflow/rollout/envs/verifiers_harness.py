"""An in-process chat harness for verifiers environments: the model's multi-turn, tool-calling loop run on
rollflow's event loop instead of a ``uv`` program.

verifiers' own harnesses (``null``, ``bash``, ...) run their programs with ``uv``, which they install and
resolve from the network: they cannot run offline. A taskset module that exports ``ChatHarness`` in its
``__all__`` gets it as its default harness (``verifiers.v1.configs.env.default_agent_harness``). It talks to
the episode's interception endpoint like verifiers' chat program does (so the episode's trace, stops and
rewards are verifiers' own), calls the task's MCP tools with verifiers' own MCP client helpers, and stops
when the model answers without a tool call or after ``max_turns`` model calls.

Importing this module imports verifiers (``pip install 'rollflow[envs]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from typing import Any

from rollflow.rollout.envs.verifiers_env import import_verifiers

vf = import_verifiers()

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402 - verifiers (and its openai pin) first, for the error message
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp  # noqa: E402


class ChatHarnessConfig(vf.HarnessConfig):
    """``ChatHarness``'s settings (``env.args.agent.harness``; its ``id`` is the taskset's)."""

    max_turns: int = 8
    """Most model calls in one episode."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """The model answers, calls the task's tools, and answers again, up to ``max_turns`` calls."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> Any:
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=_http())
        specs = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        async with contextlib.AsyncExitStack() as stack:
            tools, dispatch, servers = await connect_mcp({"mcpServers": specs}, stack)
            for _ in range(self.config.max_turns):
                extra = {"tools": tools} if tools else {}
                response = await client.chat.completions.create(model=ctx.model, messages=messages, **extra)
                if not response.choices:  # the interception ended the episode (a stop fired)
                    break
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": await _tool_result(servers, dispatch, call),
                        }
                    )
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


# One HTTP client per event loop for every episode (harness objects are per episode): a client per episode
# would load the system's CA certificates each time (tens of ms of CPU) for a loopback endpoint.
_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def _http() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _HTTP.get(loop)
    if client is None:
        # Room for every concurrent episode's connection to be kept: new connections come in bursts at the
        # start of each step, and a burst is where the interception server dropped a few.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        client = _HTTP[loop] = httpx.AsyncClient(timeout=None, limits=limits)
    return client


async def _tool_result(servers: Any, dispatch: dict[str, Any], call: Any) -> Any:
    """The tool's answer, or the reason it could not run, as the model sees it (a bad call is the model's
    mistake, to learn from, not the environment's failure)."""
    name = call.function.name
    if name not in dispatch:
        return f"error: no tool named {name!r}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as error:
        return f"error: the arguments are not JSON ({error})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    return await call_mcp(servers, dispatch, name, arguments)
