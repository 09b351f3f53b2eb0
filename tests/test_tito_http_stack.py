"""TITO on the HTTP stack: proxy → router → two real ``rollflow serve`` servers. Sessions stick to a server
while open and are released from the router when closed; agents reach sessions by an advertised URL; the
proxy lets go of its socket even when its close is cancelled."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
import pytest_asyncio

from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import InferenceRouter
from rollflow.launch.server_group import free_port
from rollflow.tito import TITOProxy
from tests.helpers.tito import MODEL, ScriptedClient, assert_parity
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.http_only(reason="TITO's session pins and sockets on the router"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(inference_servers):
    async with InferenceRouter(inference_servers.urls, health_check_interval_s=0.5) as router:
        yield router


@pytest.mark.slow
async def test_100_sessions_through_the_router_leave_no_pins(router, inference_servers, tiny_chat):
    client = RemoteInferenceClient(router.url, inference_servers.urls)
    try:
        async with TITOProxy(
            client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=3
        ) as proxy:
            pinned_while_open = []

            async def agent(index: int) -> None:
                session = await proxy.open_session(f"agent-{index}")
                async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0) as api:
                    history = [{"role": "user", "content": f"task {index}"}]
                    for turn in range(2 if index % 10 == 0 else 1):
                        reply = await api.chat.completions.create(model=MODEL, messages=history, seed=turn)
                        history += [reply.choices[0].message.model_dump(exclude_none=True)]
                        history += [{"role": "user", "content": "more"}]
                pinned_while_open.append(session.session_id in router._sessions)
                trace = await proxy.close_session(session)
                assert not trace.errors and len(trace.turns) == (2 if index % 10 == 0 else 1)

            limit = asyncio.Semaphore(16)

            async def limited(index: int) -> None:
                async with limit:
                    await agent(index)

            await asyncio.gather(*(limited(i) for i in range(100)))
        assert all(pinned_while_open) and len(pinned_while_open) == 100
        assert len(router._sessions) == 0  # each close told the router (finish_session)
        table = router.worker_table()
        assert all(worker["sessions"] == 0 for worker in table)
        assert all(worker["requests"] > 0 for worker in table)  # sessions were spread over both servers
    finally:
        await client.close()


async def test_multi_turn_tool_session_over_http_is_token_exact(router, inference_servers, tiny_chat):
    """The same parity as in process: what the servers sampled is what is trained, after the exact
    prompts they got (the policy wraps the HTTP client)."""
    from tests.helpers.tito import ScriptedPolicy

    remote = RemoteInferenceClient(router.url, inference_servers.urls)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    policy = ScriptedPolicy(remote, tiny_chat.tokenizer, lambda index, _: call if index == 0 else None)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    try:
        async with TITOProxy(
            policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=24
        ) as proxy:
            session = await proxy.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0) as api:
                history = [{"role": "user", "content": "add"}]
                first = await api.chat.completions.create(model=MODEL, messages=history, tools=tools)
                (tool_call,) = first.choices[0].message.tool_calls
                history += [first.choices[0].message.model_dump(exclude_none=True)]
                history += [{"role": "tool", "tool_call_id": tool_call.id, "content": "2"}]
                await api.chat.completions.create(model=MODEL, messages=history, tools=tools, stop=["e"])
            trace = await proxy.close_session(session)
        decode = lambda ids: tiny_chat.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        assert [t.render.method for t in trace.turns] == ["full", "bridge"]
        assert assert_parity(trace, policy.calls, ["e"], decode) == sum(
            len(t.completion_ids) for t in trace.turns
        )
        assert session.session_id not in router._sessions
    finally:
        await remote.close()


async def test_advertised_url_reaches_a_proxy_on_all_interfaces(tiny_chat):
    port = free_port()
    scripted = ScriptedClient(tiny_chat.tokenizer)
    async with TITOProxy(
        scripted,
        tiny_chat.renderer,
        tiny_chat.tokenizer,
        model_name=MODEL,
        host="0.0.0.0",
        port=port,
        advertise_url=f"http://localhost:{port}/",
    ) as proxy:
        session = await proxy.open_session()
        assert session.base_url.startswith(f"http://localhost:{port}/sessions/")
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0) as api:
            reply = await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert reply.choices[0].message.content == "reply 0"


async def test_close_releases_the_socket_even_when_cancelled(tiny_chat):
    scripted = ScriptedClient(tiny_chat.tokenizer, delay_s=30)
    proxy = TITOProxy(scripted, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL)
    await proxy.start()
    session = await proxy.open_session()
    api = openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0)
    request = asyncio.ensure_future(
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    )
    await wait_until(lambda: scripted.requests, "the request is in flight")
    closing = asyncio.ensure_future(proxy.close())
    await wait_until(lambda: session.closed, "close() waits on the request's drain")
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    with socket.socket() as probe:  # the port is free again: the listener is gone
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((proxy.host, proxy.port))
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    await api.close()
