"""Side calls (``rollflow.tito.side_calls``): calls a session rule names (by model name, by header, by a
predicate in config) are answered by the real tiny model, recorded in the session's tree as non-trainable
branches, and counted per kind; the trainable calls around them train exactly what they sampled. Driven by
the official openai SDK (Chat Completions and Responses) and the anthropic SDK against the real proxy."""

from __future__ import annotations

import openai
import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.tito import TITOProxy, compose
from rollflow.tito.side_calls import SideCallRule, safe_kind
from tests.helpers.tito import MODEL, ScriptedPolicy, assert_parity

SIDE_MODEL = "claude-3-5-haiku-latest"


def title_side_call(request) -> str | None:
    """A predicate: requests whose last message asks for a title are side calls of kind ``title``."""
    last = request.request.messages[-1].content
    return "title" if isinstance(last, str) and last.startswith("Write a title") else None


def _proxy(client, tiny_chat, rule: SideCallRule) -> TITOProxy:
    policy = ScriptedPolicy(client, tiny_chat.tokenizer, lambda call, request: None)
    proxy = TITOProxy(
        policy,
        tiny_chat.renderer,
        tiny_chat.tokenizer,
        model_name=MODEL,
        default_max_tokens=6,
        side_calls=rule,
    )
    proxy.policy = policy
    return proxy


def _trained_nodes(trace) -> set[int]:
    """Ids of the sampled nodes whose tokens some composed sample trains (both modes)."""
    trained = set()
    for mode in ("per_branch", "step_wise"):
        for sample in compose(trace, reward=1.0, mode=mode, max_seq_len=100_000):
            if any(sample.loss_mask):
                full = sample.prompt_token_ids + sample.completion_token_ids
                for node in trace.nodes:
                    if node.sampled and node.id not in trained:
                        tokens = node.token_ids.tolist()
                        end = node.start + len(tokens)
                        mask = [False] * len(sample.prompt_token_ids) + sample.loss_mask
                        if full[node.start : end] == tokens and any(mask[node.start : end]):
                            trained.add(node.id)
    return trained


async def test_side_calls_by_model_header_and_predicate_are_answered_recorded_and_never_trained(
    inference_client, tiny_chat
):
    rule = SideCallRule(
        models=("*haiku*",), header="x-side-call", predicate="tests.test_tito_side_calls:title_side_call"
    )
    async with _proxy(inference_client, tiny_chat, rule) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            history = [{"role": "user", "content": "name a fruit"}]
            first = await client.chat.completions.create(model=MODEL, messages=history)
            # A title for the conversation, under another model name: served, not trained.
            await client.chat.completions.create(
                model=SIDE_MODEL, messages=[*history, {"role": "user", "content": "a title please"}]
            )
            # Marked by a header, through the Responses API, streamed.
            async with client.responses.stream(
                model=MODEL, input="summarize", extra_headers={"X-Side-Call": "summary"}
            ) as stream:
                async for _ in stream:
                    pass
            # Named by the predicate.
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a title for: fruit"}]
            )
            history += [first.choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "another"}]
            await client.chat.completions.create(model=MODEL, messages=history)
        import anthropic  # here, not at the top: ~2 s in every collecting worker

        async with anthropic.AsyncAnthropic(
            base_url=session.base_url.removesuffix("/v1"), api_key="unused", max_retries=0
        ) as agent:
            await agent.messages.create(
                model=SIDE_MODEL, messages=[{"role": "user", "content": "is this a new topic?"}], max_tokens=4
            )
            counted = await agent.messages.count_tokens(
                model=SIDE_MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        trace = await proxy.close_session(session)
    assert counted.input_tokens > 0
    assert trace.errors == [] and len(trace.turns) == 6
    kinds = {"model:claude-3-5-haiku-latest": 2, "summary": 1, "title": 1}
    assert trace.side_calls == kinds and trace.stats.side_calls == 4
    side_turns = [turn for turn in trace.turns if (turn.options or {}).get("side_call")]
    assert sorted(turn.index for turn in side_turns) == [1, 2, 3, 5]
    assert set(trace.side_nodes) == {turn.node.id for turn in side_turns}
    # The two trainable calls (one branch: the second extends the first) are trained, exactly once each.
    main_nodes = {trace.turns[0].node.id, trace.turns[4].node.id}
    assert _trained_nodes(trace) == main_nodes
    main_calls = [proxy.policy.calls[i] for i in (0, 4)]
    assert assert_parity(trace, main_calls) == sum(len(c[1]) for c in main_calls)
    metrics = trace.to_dict()
    assert metrics["side_calls"] == kinds
    assert [t["options"].get("side_call") for t in metrics["turns"] if t["options"]].count("title") == 1
    from rollflow.tito import trace_metrics

    counts = trace_metrics(trace, compose(trace, reward=0.0, max_seq_len=100_000))
    assert counts["num_side_calls"] == 4 and counts["num_side_calls_title"] == 1


async def test_without_a_rule_other_model_names_are_refused_and_every_call_is_trainable(
    inference_client, tiny_chat
):
    async with _proxy(inference_client, tiny_chat, SideCallRule(header="x-side-call")) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match="not served here"):
                await client.chat.completions.create(
                    model=SIDE_MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        trace = await proxy.close_session(session)
    assert trace.side_calls == {} and _trained_nodes(trace) == {trace.turns[0].node.id}


def test_kinds_are_safe_metric_names_and_the_rule_survives_pickling():
    import pickle

    assert safe_kind("model:claude 3/haiku") == "model:claude_3_haiku"
    assert safe_kind("") == "side" and len(safe_kind("x" * 100)) == 64
    rule = SideCallRule(
        models=["a*"], header="X-Kind", predicate="tests.test_tito_side_calls:title_side_call"
    )
    again = pickle.loads(pickle.dumps(rule))
    assert again.models == ("a*",) and again.header == "x-kind" and again.predicate == rule.predicate
    assert again.model_kind("abc") == "model:abc" and again.model_kind("b") is None
    assert not SideCallRule().active


def test_a_predicate_returning_something_else_is_a_clear_error():
    from rollflow.tito.wire import ChatCompletionRequest

    rule = SideCallRule(predicate="builtins:id")
    chat = ChatCompletionRequest(model=MODEL, messages=[])
    with pytest.raises(TypeError, match="agent.side_calls.predicate 'builtins:id' returned"):
        rule.kind("chat", MODEL, {}, chat)


AGENT = ["agent.callable='pkg.mod:agent'", "agent.max_seq_len=512"]


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        ([*AGENT, "agent.side_calls.header='x side'"], ["agent.side_calls.header"]),
        ([*AGENT, "agent.side_calls.models=['']"], ["agent.side_calls.models[0]"]),
        ([*AGENT, "agent.side_calls.models=['rollflow:tiny']"], ["agent.side_calls.models[0]", "model.path"]),
        ([*AGENT, "agent.side_calls.predicate='nocolon'"], ["agent.side_calls.predicate"]),
        ([*AGENT, "agent.side_calls.modles=['x']"], ["modles"]),
    ],
)
def test_side_call_config_errors_name_the_field(overrides, fields):
    with pytest.raises(ConfigError) as error:
        load_config([], overrides)
    for field in fields:
        assert field in str(error.value)


def test_side_call_config_reaches_the_proxy_options():
    from rollflow.orchestrator.builders import proxy_options

    config = load_config(
        [], [*AGENT, "agent.side_calls.models=['*haiku*']", "agent.side_calls.header='x-side-call'"]
    )
    rule = proxy_options(config)["side_calls"]
    assert rule.models == ("*haiku*",) and rule.header == "x-side-call" and rule.active
