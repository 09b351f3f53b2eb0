"""Composer modes and masking, a user composer by import path, and the proof that composed samples hold
exactly the sampled tokens: the model's own logprobs recomputed on them equal the recorded ones."""

from __future__ import annotations

import openai
import pytest

from rollflow.errors import ConfigError
from rollflow.tito import TITOProxy, compose, resolve_composer, trace_metrics
from tests.helpers.tito import (
    MODEL,
    ScriptedClient,
    as_history_message,
    ask,
    make_session,
)

pytestmark = pytest.mark.asyncio


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


async def _branched_trace(tiny_chat):
    """Two turns, then a summarized history continuing from scratch: two branches."""
    client = ScriptedClient(tiny_chat.tokenizer)
    session = make_session(client, tiny_chat)
    history = [_user("one")]
    first = await ask(session, history)
    history += [as_history_message(first), _user("two")]
    await ask(session, history)
    await ask(session, [_user("summary"), _user("three")])
    session.trace.sealed = True
    return session.trace, client


async def test_per_branch_trains_every_sampled_token_once(tiny_chat):
    trace, client = await _branched_trace(tiny_chat)
    first, second = compose(trace, reward=2.0, mode="per_branch", max_seq_len=512)
    assert (first.reward, second.reward, first.sample_index, second.sample_index) == (2.0, 2.0, 0, 1)
    out = client.outputs
    assert sum(first.loss_mask) == len(out[0].token_ids) + len(out[1].token_ids)
    assert sum(second.loss_mask) == len(out[2].token_ids)
    # Context tokens inside the completion (the user turn between) are masked with logprob 0.0.
    for sample in (first, second):
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
        assert sample.prompt_token_ids + sample.completion_token_ids
        assert sample.loss_mask[0] and not sample.masked
    assert [lp for lp, m in zip(first.logprobs, first.loss_mask, strict=True) if m] == out[0].logprobs + out[
        1
    ].logprobs
    assert first.policy_versions[0] == 0 and max(first.policy_versions) == 1


async def test_shared_sampled_node_is_trained_in_the_first_branch_only(tiny_chat):
    client = ScriptedClient(tiny_chat.tokenizer)
    session = make_session(client, tiny_chat)
    first = await ask(session, [_user("go")])
    for text in ("left", "right"):
        await ask(session, [_user("go"), as_history_message(first), _user(text)])
    left, right = compose(session.trace, reward=1.0, max_seq_len=512)
    opening = len(client.outputs[0].token_ids)
    assert sum(left.loss_mask) == opening + len(client.outputs[1].token_ids)
    assert sum(right.loss_mask) == len(client.outputs[2].token_ids)
    assert len(right.prompt_token_ids) > len(left.prompt_token_ids)  # the shared turn is context in `right`


async def test_single_branch_and_step_wise(tiny_chat):
    trace, client = await _branched_trace(tiny_chat)
    (masked,) = compose(trace, reward=1.0, mode="single_branch", max_seq_len=512)
    assert masked.masked and masked.mask_reason == "not_single_branch"
    steps = compose(trace, reward=1.0, mode="step_wise", max_seq_len=512)
    assert len(steps) == 3
    for step, request, output in zip(steps, client.requests, client.outputs, strict=True):
        assert step.prompt_token_ids == request.prompt_token_ids
        assert step.completion_token_ids == output.token_ids and all(step.loss_mask)
        assert step.logprobs == output.logprobs

    session = make_session(ScriptedClient(tiny_chat.tokenizer), tiny_chat)
    await ask(session, [_user("only")])
    (single,) = compose(session.trace, reward=1.0, mode="single_branch", max_seq_len=512)
    assert not single.masked and all(single.loss_mask)


async def test_error_timeout_and_overlong(tiny_chat):
    trace, _ = await _branched_trace(tiny_chat)
    trace.timed_out = True
    samples = compose(trace, reward=1.0, max_seq_len=512)
    assert {s.mask_reason for s in samples} == {"timeout"}
    metrics = trace_metrics(trace, samples)
    assert (metrics["is_timeout"], metrics["is_error"], metrics["num_branches"]) == (1.0, 0.0, 2.0)
    trace.timed_out, trace.error = False, "agent crashed"
    samples = compose(trace, reward=1.0, max_seq_len=512)
    assert {s.mask_reason for s in samples} == {"error"}
    assert trace_metrics(trace, samples)["is_error"] == 1.0
    trace.error = None

    first = compose(trace, reward=1.0, max_seq_len=512)[0]
    limit = len(first.prompt_token_ids) + 3
    cut = compose(trace, reward=1.0, max_seq_len=limit)[0]
    assert not cut.masked and cut.completion_token_ids == first.completion_token_ids[:3]
    assert len(cut.loss_mask) == len(cut.logprobs) == len(cut.policy_versions) == 3
    filtered = compose(trace, reward=1.0, max_seq_len=limit, filter_overlong=True)[0]
    assert filtered.masked and filtered.mask_reason == "overlong"
    with pytest.raises(ValueError, match="mode"):
        compose(trace, reward=1.0, mode="per_turn", max_seq_len=10)


def my_composer(trace, *, reward, mode, max_seq_len, filter_overlong=False, prompt_index=0):
    return compose(trace, reward=reward * 10, mode="step_wise", max_seq_len=max_seq_len)


async def test_user_composer_by_import_path(tiny_chat):
    trace, _ = await _branched_trace(tiny_chat)
    composer = resolve_composer("tests.test_tito_composer:my_composer")
    samples = composer(trace, reward=1.0, mode="per_branch", max_seq_len=512)
    assert len(samples) == 3 and samples[0].reward == 10.0
    assert resolve_composer(None) is compose
    with pytest.raises(ConfigError, match="composer"):
        resolve_composer("tests.test_tito_composer:nothing_here")


async def test_recorded_logprobs_equal_recomputed_ones(inference_client, tiny_chat):
    """The proof: tokens in every composed sample are exactly the sampled ones."""
    import torch

    from rollflow.models.loading import load_causal_lm

    async with TITOProxy(
        inference_client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL
    ) as proxy:
        session = await proxy.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        history = [{"role": "system", "content": "answer"}, _user("name a fruit")]
        for turn in range(4):
            response = await client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=10, seed=turn
            )
            history += [response.choices[0].message.model_dump(exclude_none=True), _user(f"again {turn}")]
        summary = [
            {"role": "system", "content": "answer"},
            _user("summary: fruits were named"),
            _user("one more"),
        ]
        stream = await client.chat.completions.create(
            model=MODEL, messages=summary, max_tokens=10, stream=True
        )
        async for _ in stream:
            pass
        trace = await proxy.close_session(session)

    model = load_causal_lm(tiny_chat.model_dir)
    checked = 0
    for mode in ("per_branch", "step_wise"):
        for sample in compose(trace, reward=1.0, mode=mode, max_seq_len=512):
            ids = sample.prompt_token_ids + sample.completion_token_ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            logprobs = torch.log_softmax(logits[:-1], dim=-1)
            offset = len(sample.prompt_token_ids)
            for i, (token, recorded, trained) in enumerate(
                zip(sample.completion_token_ids, sample.logprobs, sample.loss_mask, strict=True)
            ):
                if trained:
                    assert abs(logprobs[offset + i - 1, token].item() - recorded) < 1e-4
                    checked += 1
    assert checked == 2 * sum(len(t.completion_ids) for t in trace.turns)
    assert len(trace.leaves()) == 2
