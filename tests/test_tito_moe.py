"""TITO on a mixture-of-experts model: the official ``openai`` client drives a session over an in-process engine
of the tiny MoE model with routed experts on, and the composed samples carry the engine's real routes.

"Real" is checked against the HF model itself: a fresh full forward over a sample's tokens, the top-k of its
router, must give every row the engine recorded across the turns (prompt rows of bridged turns included).
"""

from __future__ import annotations

import copy

import numpy as np
import openai
import pytest
import torch

from rollflow.config import ModelConfig
from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.engine import TorchEngine
from rollflow.models.loading import create_chat_renderer, load_causal_lm, load_tokenizer
from rollflow.tito import TITOProxy, compose

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.local_only(reason="the MoE model's routes in process; over HTTP: test_routed_experts_wire"),
]

MODEL = "rollflow:tiny-moe"


@pytest.fixture(scope="module")
def moe_model(tiny_moe_model_dir):
    return load_causal_lm(tiny_moe_model_dir)


@pytest.fixture
async def proxy(moe_model, tiny_moe_model_dir):
    engine = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=4, max_model_len=1024, return_routed_experts=True
    )
    tokenizer = load_tokenizer(tiny_moe_model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(path=MODEL))
    async with TITOProxy(LocalInferenceClient([engine]), renderer, tokenizer, model_name=MODEL) as p:
        yield p
    await engine.shutdown()


def hf_routes(model, tokens: list[int]) -> np.ndarray:
    """The HF router's top-k experts [tokens, layers, topk] of one full forward over ``tokens``."""
    with torch.no_grad():
        router_logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    top_k = model.config.num_experts_per_tok
    return torch.stack(
        [torch.topk(logits.softmax(-1), top_k, dim=-1).indices for logits in router_logits], 1
    ).numpy()


async def ask(client: openai.AsyncOpenAI, messages: list[dict], *, seed: int, stream: bool) -> dict:
    """One turn; returns the assistant message as the agent would send it back."""
    params = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=seed)
    if not stream:
        response = await client.chat.completions.create(**params)
        return response.choices[0].message.model_dump(exclude_none=True)
    content = ""
    async for chunk in await client.chat.completions.create(**params, stream=True):
        content += "".join(choice.delta.content or "" for choice in chunk.choices)
    return {"role": "assistant", "content": content}


async def test_composed_samples_carry_the_models_real_routes(proxy, moe_model):
    session = await proxy.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for turn in range(3):
        reply = await ask(client, messages, seed=turn, stream=turn == 1)  # the second turn streams
        messages += [reply, {"role": "user", "content": f"more {turn}"}]
    trace = await proxy.close_session(session)
    assert [t.render.method for t in trace.turns] == ["full", "bridge", "bridge"]

    (sample,) = compose(trace, reward=1.0, max_seq_len=1024)
    tokens = sample.prompt_token_ids + sample.completion_token_ids
    layers, top_k = moe_model.config.num_hidden_layers, moe_model.config.num_experts_per_tok
    assert sample.routed_experts.shape == (len(tokens), layers, top_k)
    expected = hf_routes(moe_model, tokens)
    # Every row but the last is the HF router's choice on the same tokens: the prompt rows of the bridged turns,
    # and the last token of each earlier turn (the engine ran it as part of the next turn's prompt). The last
    # token of the sequence never ran: its row is a stand-in.
    for turn in trace.turns[1:]:
        np.testing.assert_array_equal(sample.routed_experts[: turn.prompt_len], expected[: turn.prompt_len])
    np.testing.assert_array_equal(sample.routed_experts[:-1], expected[:-1])
    assert len({tuple(row) for row in sample.routed_experts[:, 0]}) > 1  # routing varies by token

    # Step-wise samples (one per model call) carry the routes of their own tokens.
    for step in compose(trace, reward=1.0, mode="step_wise", max_seq_len=1024):
        step_tokens = step.prompt_token_ids + step.completion_token_ids
        assert step.routed_experts.shape == (len(step_tokens), layers, top_k)
        np.testing.assert_array_equal(step.routed_experts[:-1], expected[: len(step_tokens) - 1])


async def test_a_reply_cut_by_a_stop_string_keeps_its_routes(moe_model, tiny_moe_model_dir):
    """With routed experts on, a reply with stop strings is sampled whole and then cut: its turn keeps the
    routes of exactly the tokens kept."""
    engine = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=4, max_model_len=1024, return_routed_experts=True
    )
    tokenizer = load_tokenizer(tiny_moe_model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(path=MODEL))
    client = LocalInferenceClient([engine])
    try:
        async with TITOProxy(
            client, renderer, tokenizer, model_name=MODEL, return_routed_experts=True
        ) as proxy:
            session = await proxy.open_session()
            api = openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0)
            ask = dict(model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=24, seed=1)
            free = await api.chat.completions.create(**ask, extra_body={"return_token_ids": True})
            ids = free.choices[0].model_extra["token_ids"]
            stop = tokenizer.decode(ids[4:6], skip_special_tokens=True)
            if not stop.strip():
                pytest.skip("the sampled tokens 4..6 have no text to stop on")
            cut = await api.chat.completions.create(**ask, stop=[stop])
            assert cut.choices[0].model_extra["stop_reason"] == stop
            trace = await proxy.close_session(session)
    finally:
        await engine.shutdown()
    turn = trace.turns[1]
    assert len(turn.completion_ids) < len(ids)
    assert turn.node.routed_experts is not None
    assert turn.node.routed_experts.shape[0] == len(turn.node.token_ids)
    samples = compose(trace, reward=1.0, max_seq_len=1024)
    assert len(samples) == 2 and all(sample.routed_experts is not None for sample in samples)
