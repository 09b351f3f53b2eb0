"""Agent samples carry the sampler's kept sets: the TITO proxy records each turn's kept counts (streamed or
not, over several turns) and the composer puts them on the sampled tokens of the training sample."""

from __future__ import annotations

import openai
import pytest

from rollflow.tito import TITOProxy, compose
from tests.helpers.tito import MODEL

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("stream", [False, True])
async def test_proxy_records_kept_counts_and_the_sample_carries_them(inference_client, tiny_chat, stream):
    async with TITOProxy(
        inference_client,
        tiny_chat.renderer,
        tiny_chat.tokenizer,
        model_name=MODEL,
        default_top_k=7,
        default_max_tokens=6,
        default_temperature=0.8,
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        history = [{"role": "user", "content": "hi"}]
        for turn in range(2):
            if stream:
                async for _ in await client.chat.completions.create(
                    model=MODEL, messages=history, stream=True, seed=turn
                ):
                    pass
            else:
                await client.chat.completions.create(model=MODEL, messages=history, seed=turn)
            reply = session.trace.turns[-1]
            history += [
                {"role": "assistant", "content": reply.message.get("content") or ""},
                {"role": "user", "content": "again"},
            ]
        trace = session.trace
    sampled_nodes = [node for node in trace.nodes if node.sampled]
    assert len(sampled_nodes) == 2
    for node in sampled_nodes:
        assert node.kept_counts.tolist() == [7] * len(node.logprobs)
    saved = {node["id"]: node for node in trace.to_dict()["nodes"]}  # what agent.save_traces writes
    assert [saved[node.id]["kept_counts"] for node in sampled_nodes] == [
        node.kept_counts.tolist() for node in sampled_nodes
    ]
    for sample in compose(trace, reward=1.0, max_seq_len=512, mode="per_branch"):
        assert sample.kept_counts is not None
        assert len(sample.kept_counts) == len(sample.completion_token_ids)
        # 7 exactly where tokens were sampled (trained), 0 on the context between turns.
        assert sample.kept_counts == [7 if trained else 0 for trained in sample.loss_mask]


async def test_untruncated_agent_samples_carry_no_kept_counts(inference_client, tiny_chat):
    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, default_max_tokens=4
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        trace = session.trace
    (sample,) = compose(trace, reward=0.0, max_seq_len=512)
    assert sample.kept_counts is None
