"""Agent libraries people train with, each through a full multi-turn, tool-using episode against the proxy
on the tiny model: the openai SDK, litellm, the openai-agents SDK and smolagents' tool-calling agent.

The tiny model's replies are gibberish, so its tool calls are forced: ``ScriptedPolicy`` wraps the real
model (``inference_client``, in the suite's inference mode) and, on the calls a script names, streams chosen tokens (a ``<tool_call>`` block, closed with the stop
token) instead of sampling; the other calls are real samples of the tiny model. Each library then sends what
it really sends (smolagents: ``stop`` strings and ``tool_choice: "required"``; openai-agents: its own message
shapes; the SDKs: ``extra_body`` fields), and each test checks that the episode ends without an error and that
the composed samples train exactly the tokens each engine call returned, after exactly the prompt it got
(``assert_parity``), a stop string's cut included.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from rollflow.tito import TITOProxy
from tests.helpers.tito import ADD_PARAMETERS, MODEL, ScriptedPolicy, assert_parity, tool_call_text

pytestmark = pytest.mark.asyncio

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": ADD_PARAMETERS,
    },
}


def _policy(client, chat, script) -> ScriptedPolicy:
    return ScriptedPolicy(client, chat.tokenizer, script)


def _decode(chat):
    return lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True)


async def _episode_trace(proxy: TITOProxy, session) -> object:
    trace = await proxy.close_session(session)
    assert trace.errors == [] and trace.error is None
    return trace


async def test_openai_sdk_tool_episode(inference_client, tiny_chat):
    script = {0: tool_call_text("add", a=2, b=3)}
    policy = _policy(inference_client, tiny_chat, lambda call, _: script.get(call))
    async with TITOProxy(
        policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
    ) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            messages = [{"role": "user", "content": "add 2 and 3"}]
            extra = {"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}
            first = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=[ADD_TOOL], extra_body=extra
            )
            (call,) = first.choices[0].message.tool_calls
            messages += [first.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "5"}]
            second = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=[ADD_TOOL], stop=["\n\n"], extra_body=extra
            )
        trace = await _episode_trace(proxy, session)
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert [t.render.method for t in trace.turns] == ["full", "bridge"]
    assert second.choices[0].model_extra["token_ids"] == trace.turns[1].completion_ids
    assert assert_parity(trace, policy.calls, ["\n\n"], _decode(tiny_chat)) > 0


@pytest.mark.slow
async def test_litellm_tool_episode(inference_client, tiny_chat):
    litellm = pytest.importorskip("litellm")
    script = {0: tool_call_text("add", a=4, b=1)}
    policy = _policy(inference_client, tiny_chat, lambda call, _: script.get(call))
    async with TITOProxy(
        policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
    ) as proxy:
        session = await proxy.open_session()
        ask = {
            "model": f"openai/{MODEL}",
            "api_base": session.base_url,
            "api_key": "unused",
            "tools": [ADD_TOOL],
        }
        messages = [{"role": "user", "content": "add 4 and 1"}]
        first = await litellm.acompletion(**ask, messages=messages, top_k=10, stop=["zz"])
        message = first.choices[0].message
        (call,) = message.tool_calls
        messages += [
            {"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        stream = await litellm.acompletion(**ask, messages=messages, stream=True)
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        trace = await _episode_trace(proxy, session)
    assert trace.turns[1].message["content"] == streamed
    assert trace.turns[1].render.method == "bridge"
    assert assert_parity(trace, policy.calls) > 0


async def test_openai_agents_sdk_tool_episode(inference_client, tiny_chat):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no export of traces to OpenAI
    added = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        added.append((a, b))
        return a + b

    script = {0: tool_call_text("add", a=20, b=22)}
    policy = _policy(inference_client, tiny_chat, lambda call, _: script.get(call))
    async with TITOProxy(
        policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="calculator",
            instructions="Add with the tool.",
            tools=[add],
            model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        )
        result = await agents.Runner.run(agent, "What is 20 + 22?", max_turns=4)
        trace = await _episode_trace(proxy, session)
    assert added == [(20, 22)] and isinstance(result.final_output, str)
    assert len(trace.turns) == 2 and trace.turns[0].finish_reason == "tool_calls"
    assert assert_parity(trace, policy.calls) > 0


async def test_smolagents_tool_calling_agent_episode(inference_client, tiny_chat):
    smolagents = pytest.importorskip("smolagents")

    @smolagents.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        return a + b

    # The first reply calls the tool and then makes up an observation: the stop string smolagents sends
    # ("Observation:") ends it there. The second calls smolagents' final_answer tool.
    script = {
        0: tool_call_text("add", a=2, b=40) + "\nObservation: 42",
        1: tool_call_text("final_answer", answer="42"),
    }
    policy = _policy(inference_client, tiny_chat, lambda call, _: script.get(call))
    async with TITOProxy(
        policy, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=48
    ) as proxy:
        session = await proxy.open_session()
        model = smolagents.OpenAIModel(
            model_id=MODEL, api_base=session.base_url, api_key="unused", client_kwargs={"max_retries": 0}
        )
        agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=3, verbosity_level=0)
        # A short system prompt: the tiny model's context is 2048 tokens (the template's own is longer).
        agent.prompt_templates["system_prompt"] = "Solve the task with the tools. Finish with final_answer."
        answer = await asyncio.to_thread(agent.run, "What is 2 + 40?")
        trace = await _episode_trace(proxy, session)
    assert str(answer) == "42"
    assert [step.error for step in agent.memory.steps if hasattr(step, "error")] == [None, None]
    first = trace.turns[0]
    assert first.options["stop_reason"] == "Observation:" and first.finish_reason == "tool_calls"
    assert trace.stats.ignored_values == 2  # tool_choice "required", not enforceable, on each call
    assert assert_parity(trace, policy.calls, ["Observation:", "Calling tools:"], _decode(tiny_chat)) > 0
