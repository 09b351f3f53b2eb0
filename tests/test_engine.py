"""TorchEngine: exactness against Hugging Face, continuous batching, sampling, pause modes, weights, failures.

Greedy comparisons use a copy of the tiny model with re-drawn, larger weights: the random-init tiny model
repeats one token greedily, which would let a broken KV cache or position bookkeeping pass unnoticed.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.errors import EngineDeadError, EngineError, EngineGenerateError
from rollflow.inference.engine import TorchEngine
from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from rollflow.models.tiny import ensure_tiny_model

from .helpers.training import redraw_matrices
from .helpers.waits import wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def varied_model(tiny_model):
    """The tiny model with matrices re-drawn at std 0.3 (seeded): its greedy continuations vary token to token."""
    model = copy.deepcopy(tiny_model)
    return redraw_matrices(model)


@pytest.fixture
async def engine(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=8, max_model_len=512)
    yield engine
    await engine.shutdown()


def make_prompts(lengths: list[int], seed: int = 0, vocab_size: int = 1000) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def request(prompt: list[int], params: SamplingParams = GREEDY, request_id: str = "") -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, sampling=params, request_id=request_id)


def hf_logprobs(model, prompt: list[int], output: GenerateOutput, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / temperature) of a full forward on prompt + output, at the output tokens, over
    each token's kept set (its ``kept_counts`` largest scaled logits) when the output records them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output.token_ids])).logits[0]
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    for row, count in enumerate(output.kept_counts or []):
        if count:
            scaled[row, scaled[row].sort(descending=True, stable=True).indices[count:]] = float("-inf")
    logprobs = torch.log_softmax(scaled, dim=-1)
    return logprobs.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0].tolist()


# ---------------------------------------------------------------------------- exactness


async def test_greedy_matches_hf_generate(engine, varied_model):
    prompts = make_prompts([5, 17, 9, 30, 1])
    eos = varied_model.config.eos_token_id
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(eos,))
    outputs = await asyncio.gather(*(engine.generate(request(p, params)) for p in prompts))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = varied_model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert output.token_ids == expected
        assert output.prompt_len == len(prompt)
        reason = FinishReason.STOP if expected[-1] == eos else FinishReason.LENGTH
        assert output.finish_reason == reason
    assert len({tuple(o.token_ids) for o in outputs}) == len(prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_hf_forward(engine, varied_model, temperature):
    prompts = make_prompts([4, 11, 23], seed=1)
    # top_k filters the draw and the reported logprob: renormalised over the 20 tokens kept.
    params = SamplingParams(max_tokens=20, temperature=temperature, top_k=20, seed=7)
    outputs = await asyncio.gather(*(engine.generate(request(p, params)) for p in prompts))
    diffs = []
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.logprobs) == len(output.token_ids) == 20
        assert output.kept_counts == [20] * 20
        expected = hf_logprobs(varied_model, prompt, output, temperature)
        diffs += [abs(a - b) for a, b in zip(output.logprobs, expected, strict=True)]
    mean_diff = sum(diffs) / len(diffs)
    print(f"temperature {temperature}: mean |engine - HF| logprob diff {mean_diff:.2e}, max {max(diffs):.2e}")
    assert mean_diff < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
async def test_other_llama_style_architectures_match_hf(model_type):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))  # q/k/v biases, no q/k norm
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.eval()
    engine = TorchEngine(model, max_batch_size=4, max_model_len=128)
    try:
        prompts = make_prompts([3, 9], vocab_size=300)
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
        outputs = await asyncio.gather(*(engine.generate(request(p, params)) for p in prompts))
    finally:
        await engine.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_logprobs(model, prompt, output)
        assert max(abs(a - b) for a, b in zip(output.logprobs, expected, strict=True)) < 1e-4


def test_unsupported_architecture_names_model_type():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64))
    with pytest.raises(EngineError, match="'gpt2'"):
        TorchEngine(model.eval())


def test_engine_package_import_does_not_import_torch():
    code = "import sys, rollflow.inference.engine; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- scheduling


async def test_continuous_batching_matches_solo_results(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=3, max_model_len=256)
    try:
        prompts = make_prompts([7, 3, 25, 12, 5, 18, 9], seed=2)
        max_tokens = [5, 200, 150, 12, 60, 1, 25]
        requests = [
            request(p, SamplingParams(max_tokens=n, temperature=0.0), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        solo = [await engine.generate(r) for r in requests]

        seen_running = set()

        async def watch() -> None:
            while True:
                seen_running.add(engine.num_running)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        # Four requests for three slots, released at once: one has to queue (prefill of three ragged prompts).
        await engine.pause("keep")
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests[:4]]
        await wait_until(lambda: engine.num_waiting == 4, "the four requests queue")
        await engine.resume()
        # r0 and then r3 (in r0's slot) finish: slot 0 is empty while slots 1 and 2 decode.
        await wait_until(lambda: engine.num_running == 2 and engine.num_waiting == 0, "r0 and r3 finish")
        for r in requests[4:]:  # later ones join while the long ones are decoding
            await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(engine.generate(r)))
        together = await asyncio.gather(*tasks)
        watcher.cancel()
    finally:
        await engine.shutdown()
    for alone, batched, n in zip(solo, together, max_tokens, strict=True):
        assert batched.token_ids == alone.token_ids
        assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert batched.request_id == alone.request_id
        assert len(batched.token_ids) == n and batched.finish_reason == FinishReason.LENGTH
    assert max(seen_running) == 3
    assert engine.total_generated_tokens == 2 * sum(max_tokens)


async def test_context_limit_finishes_with_length(engine):
    prompt = make_prompts([505])[0]
    output = await engine.generate(request(prompt, SamplingParams(max_tokens=100, temperature=0.0)))
    assert len(output.token_ids) == 512 - 505
    assert output.finish_reason == FinishReason.LENGTH
    # The longest allowed prompt (max_model_len - 1) still gets one token.
    output = await engine.generate(request(make_prompts([511])[0]))
    assert len(output.token_ids) == 1 and output.finish_reason == FinishReason.LENGTH


async def test_overlong_prompt_is_rejected_and_engine_keeps_serving(engine):
    with pytest.raises(EngineError, match="max_model_len is 512"):
        await engine.generate(request(make_prompts([512])[0]))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await engine.generate(request([5, 10**6]))
    output = await engine.generate(request(make_prompts([8])[0]))
    assert len(output.token_ids) == GREEDY.max_tokens


async def test_cancelled_callers_free_their_slot_and_queue_place(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=1, max_model_len=512)
    try:
        running = asyncio.create_task(engine.generate(request([5, 6, 7], SamplingParams(max_tokens=400))))
        await wait_until(lambda: engine.num_running == 1, "the request is running")
        # Frozen, the requests could only leave through the cancellations.
        await engine.pause("keep")
        queued = asyncio.create_task(engine.generate(request([1, 2], SamplingParams(max_tokens=400))))
        await wait_until(lambda: engine.num_waiting == 1, "the second request queues")
        for task in (running, queued):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_until(
            lambda: engine.num_running == 0 and engine.num_waiting == 0, "the cancelled requests leave"
        )
        await engine.resume()
        output = await asyncio.wait_for(engine.generate(request([8, 9], SamplingParams(max_tokens=2))), 60)
        assert len(output.token_ids) == 2
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert engine.total_generated_tokens < 400, "a cancelled request kept generating"
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------------------- sampling


async def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    prompt = make_prompts([10], seed=3)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    alone = await engine.generate(request(prompt, params))
    again = await engine.generate(request(prompt, params))
    others = [
        request(p, SamplingParams(max_tokens=30, temperature=1.0, seed=s))
        for p, s in zip(make_prompts([3, 20, 7, 15], seed=4), [None, 5, None, 9], strict=True)
    ]
    crowded = await asyncio.gather(
        *(engine.generate(r) for r in [*others[:2], request(prompt, params), *others[2:]])
    )
    other_seed = await engine.generate(
        request(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=124))
    )
    assert again.token_ids == alone.token_ids
    assert crowded[2].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


async def test_temperature_zero_and_top_k_one_are_greedy(engine, varied_model):
    prompts = make_prompts([6, 13], seed=5)
    greedy = await asyncio.gather(*(engine.generate(request(p)) for p in prompts))
    top1 = SamplingParams(max_tokens=12, temperature=0.8, top_k=1)
    top_one = await asyncio.gather(*(engine.generate(request(p, top1)) for p in prompts))
    for g, t, prompt in zip(greedy, top_one, prompts, strict=True):
        assert t.token_ids == g.token_ids
        # Temperature 0 reports plain log_softmax; top_k=1 draws from one token: logprob 0, one token kept.
        assert g.logprobs == pytest.approx(hf_logprobs(varied_model, prompt, g), abs=1e-4)
        assert g.kept_counts is None
        assert t.logprobs == [0.0] * len(t.token_ids)
        assert t.kept_counts == [1] * len(t.token_ids)


async def test_stop_token_ends_generation_and_is_included(engine):
    prompt = make_prompts([9], seed=6)[0]
    full = await engine.generate(request(prompt))
    stop = full.token_ids[4]
    end = full.token_ids.index(stop) + 1
    output = await engine.generate(
        request(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,)))
    )
    assert output.token_ids == full.token_ids[:end]
    assert output.token_ids[-1] == stop
    assert output.finish_reason == FinishReason.STOP


# ---------------------------------------------------------------------------- pause / resume


async def test_pause_abort_returns_partial_tokens_and_holds_new_requests(engine):
    long = SamplingParams(max_tokens=480, temperature=1.0)
    tasks = [asyncio.create_task(engine.generate(request(p, long))) for p in make_prompts([5, 9])]
    await wait_until(lambda: engine.total_generated_tokens >= 10, "some tokens are sampled")
    await engine.pause("abort")
    assert engine.is_paused
    for output in await asyncio.gather(*tasks):
        assert output.finish_reason == FinishReason.ABORT
        assert 0 < len(output.token_ids) < 480
        assert len(output.logprobs) == len(output.policy_versions) == len(output.token_ids)
    late = asyncio.create_task(engine.generate(request([3, 4, 5])))
    await wait_until(lambda: engine.num_waiting == 1, "the late request queues")
    assert not late.done()  # held while paused
    await engine.resume()
    assert not engine.is_paused
    assert len((await asyncio.wait_for(late, 60)).token_ids) == GREEDY.max_tokens


async def test_pause_wait_drains_running_requests(engine):
    params = SamplingParams(max_tokens=60, temperature=0.0)
    tasks = [asyncio.create_task(engine.generate(request(p, params))) for p in make_prompts([4, 8])]
    await wait_until(lambda: engine.num_running == 2, "both requests are running")
    await engine.pause("wait")
    assert engine.num_running == 0
    for output in await asyncio.gather(*tasks):
        assert len(output.token_ids) == 60 and output.finish_reason == FinishReason.LENGTH
    late = asyncio.create_task(engine.generate(request([3, 4, 5])))
    await wait_until(lambda: engine.num_waiting == 1, "the late request queues")
    assert not late.done()  # held while paused
    await engine.resume()
    assert (await asyncio.wait_for(late, 60)).finish_reason == FinishReason.LENGTH


async def test_pause_keep_freezes_and_continues_unchanged(engine):
    prompt = make_prompts([6], seed=7)[0]
    params = SamplingParams(max_tokens=400, temperature=0.0)
    baseline = await engine.generate(request(prompt, params))
    generated_before = engine.total_generated_tokens
    task = asyncio.create_task(engine.generate(request(prompt, params)))
    await wait_until(lambda: engine.total_generated_tokens - generated_before >= 5, "some tokens are sampled")
    await engine.pause("keep")
    frozen_at = engine.total_generated_tokens
    await asyncio.sleep(0.2)  # a window for tokens that must not come: slowness can only hide one
    assert engine.total_generated_tokens == frozen_at and not task.done()
    assert engine.num_running == 1 and frozen_at - generated_before < 400
    await engine.resume()
    output = await asyncio.wait_for(task, 60)
    assert output.token_ids == baseline.token_ids
    assert output.finish_reason == FinishReason.LENGTH


async def test_bad_pause_mode_names_the_allowed_modes(engine):
    with pytest.raises(ValueError, match="'abort', 'wait', 'keep'"):
        await engine.pause("drop")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- weights


async def test_load_weights_changes_outputs_and_policy_versions(engine, varied_model, tiny_model):
    prompt = make_prompts([8], seed=8)[0]
    before = await engine.generate(request(prompt))
    assert before.policy_versions == [0] * len(before.token_ids)
    # The tiny model's weights; its tied lm_head.weight is absent from named_parameters, as from a trainer.
    await engine.load_weights(list(tiny_model.named_parameters()), policy_version=3)
    assert engine.policy_version == 3
    after = await engine.generate(request(prompt))
    assert after.token_ids != before.token_ids
    assert after.policy_versions == [3] * len(after.token_ids)
    assert after.logprobs == pytest.approx(hf_logprobs(tiny_model, prompt, after), abs=1e-4)


async def test_load_weights_mid_request_stamps_new_version(engine, varied_model):
    task = asyncio.create_task(engine.generate(request([5, 6], SamplingParams(max_tokens=400))))
    await wait_until(lambda: engine.total_generated_tokens >= 3, "some tokens are sampled")
    await engine.load_weights(list(varied_model.named_parameters()), policy_version=1)
    versions = (await task).policy_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


async def test_load_weights_rejects_unknown_names_atomically(engine):
    prompt = make_prompts([8], seed=9)[0]
    before = await engine.generate(request(prompt))
    zeros = torch.zeros_like(engine.model.model.norm.weight)
    with pytest.raises(EngineError, match=r"model\.layers\.0\.not_a_weight"):
        await engine.load_weights(
            [("model.norm.weight", zeros), ("model.layers.0.not_a_weight", zeros)], policy_version=1
        )
    with pytest.raises(EngineError, match="wrong shape"):
        await engine.load_weights([("model.norm.weight", torch.zeros(3))], policy_version=1)
    assert engine.policy_version == 0
    after = await engine.generate(request(prompt))
    assert after.token_ids == before.token_ids and after.policy_versions[0] == 0


# ---------------------------------------------------------------------------- lifecycle and failures


async def test_shutdown_aborts_requests_and_is_idempotent(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=1, max_model_len=512)
    long = SamplingParams(max_tokens=400)
    running = asyncio.create_task(engine.generate(request([5, 6], long)))
    waiting = asyncio.create_task(engine.generate(request([7, 8], long)))
    await wait_until(lambda: engine.total_generated_tokens >= 2, "the first request is sampling")
    await engine.shutdown()
    await engine.shutdown()
    running_output, waiting_output = await asyncio.gather(running, waiting)
    assert running_output.finish_reason == waiting_output.finish_reason == FinishReason.ABORT
    assert len(running_output.token_ids) > 0 and waiting_output.token_ids == []
    with pytest.raises(EngineDeadError):
        await engine.generate(request([5]))


async def test_idle_engine_releases_its_worker_thread(engine):
    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "rollflow-torch-engine"]

    await engine.generate(request([5, 6, 7]))
    await wait_until(lambda: not workers(), "the idle engine's worker thread ends")
    # The next call starts a new worker.
    assert len((await engine.generate(request([5, 6, 7]))).token_ids) == GREEDY.max_tokens


async def test_an_idle_engine_admits_a_burst_of_requests_in_one_step(engine):
    """Requests that reach an idle engine over several of the caller's loop iterations (a training step's
    groups) are admitted together: the engine lingers while they keep coming. Slices far longer than the gaps
    here, so a busy machine cannot split the burst."""
    engine.admission_linger_s, engine.admission_linger_max_s = 0.2, 10.0
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = make_prompts([5, 7, 9, 6, 8, 4], seed=9)
    # Admissions are counted on the engine's thread, before any output is sent (``num_steps`` is bumped after,
    # so reading it here could race the step that answered).
    admitted: list[int] = []
    admit = engine._admit

    def counting_admit(fresh, resumed, followers):
        admit(fresh, resumed, followers)
        if fresh or resumed or followers:
            admitted.append(len(fresh) + len(resumed) + len(followers))

    engine._admit = counting_admit
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(engine.generate(request(prompt, one_token))))
        await asyncio.sleep(0.001)
    outputs = await asyncio.gather(*tasks)
    assert all(len(o.token_ids) == 1 for o in outputs)
    # One admission: all six admitted and prefilled together, each finishing with its one token.
    assert admitted == [6]


async def test_engine_thread_count_stays_inside_its_worker(varied_model):
    """The worker runs with one intra-op thread; threads that start using torch later keep the process's count.
    The suite runs with one thread (conftest), so the process gets 2 here: a count the worker's 1 differs from."""
    suite_count = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=8, max_model_len=512)
    try:
        worker_counts = []
        decode = engine.runner.decode

        def counting_decode(*args):
            worker_counts.append(torch.get_num_threads())
            return decode(*args)

        engine.runner.decode = counting_decode
        await engine.generate(request([5, 6, 7]))
        assert set(worker_counts) == {1}
        fresh_counts = []
        fresh = threading.Thread(target=lambda: fresh_counts.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        assert fresh_counts == [2]
    finally:
        await engine.shutdown()
        torch.set_num_threads(suite_count)


async def test_a_failing_forward_fails_its_requests_only_and_the_engine_keeps_serving(varied_model):
    engine = TorchEngine(
        copy.deepcopy(varied_model), max_batch_size=4, max_model_len=128, enable_prefix_caching=False
    )
    expected = await engine.generate(request([5, 6, 7]))
    real_decode = engine.runner.decode

    def decode_failing_on_slot_0(token_ids, positions):
        # Fails every batch that holds slot 0, as a kernel failing on one row's data would.
        if positions[0] >= 0:
            raise RuntimeError("simulated kernel failure")
        return real_decode(token_ids, positions)

    engine.runner.decode = decode_failing_on_slot_0
    try:
        # Paused, the four queue; on resume they are admitted together, the first into slot 0.
        await engine.pause("abort")
        poisoned = asyncio.ensure_future(engine.generate(request([9, 10, 11], request_id="poisoned")))
        healthy = [asyncio.ensure_future(engine.generate(request([5, 6, 7]))) for _ in range(3)]
        await wait_until(lambda: engine.num_waiting == 4, "the four requests queue")
        await engine.resume()
        outputs = await asyncio.wait_for(asyncio.gather(*healthy), 60)
        with pytest.raises(EngineGenerateError, match="simulated kernel failure"):
            await asyncio.wait_for(poisoned, 60)
        # Batched with the failing row, the others were retried alone and match a solo run exactly.
        assert [o.token_ids for o in outputs] == [expected.token_ids] * 3
        assert not engine.is_dead and engine.num_failed_requests == 1
        engine.runner.decode = real_decode
        again = await engine.generate(request([5, 6, 7]))
        assert again.token_ids == expected.token_ids
    finally:
        await engine.shutdown()


async def test_loop_failure_reaches_callers(varied_model):
    """A failure outside the per-request isolation (the loop's own bookkeeping) still kills the engine, and
    every pending and later call raises ``EngineDeadError`` instead of hanging."""
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=4, max_model_len=128)

    def broken_take_slot(*args, **kwargs):
        raise RuntimeError("simulated bookkeeping failure")

    engine._take_slot = broken_take_slot
    try:
        with pytest.raises(EngineDeadError, match="simulated bookkeeping failure"):
            await asyncio.wait_for(engine.generate(request([5, 6, 7])), 60)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.generate(request([5, 6, 7]))
        with pytest.raises(EngineDeadError):
            await engine.pause("abort")
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------------------- prefix cache


async def test_prefix_cache_reuses_prefixes_and_matches_uncached_and_hf(varied_model):
    """Multi-turn shape: each turn's prompt extends the previous prompt and completion. Outputs with the cache
    equal outputs without it, token for token (greedy), and logprobs stay within 1e-4 of a full HF forward."""
    cached = TorchEngine(copy.deepcopy(varied_model), max_batch_size=4, max_model_len=256)
    uncached = TorchEngine(
        copy.deepcopy(varied_model), max_batch_size=4, max_model_len=256, enable_prefix_caching=False
    )
    try:
        histories = make_prompts([9, 4, 21], seed=3)
        diffs = []
        for turn in range(3):
            # All sessions of one turn are admitted together: a mix of cache hits and (turn 0) misses.
            outputs = await asyncio.gather(*(cached.generate(request(h)) for h in histories))
            expected = await asyncio.gather(*(uncached.generate(request(h)) for h in histories))
            for history, output, reference in zip(histories, outputs, expected, strict=True):
                assert output.token_ids == reference.token_ids, f"turn {turn}"
                hf = hf_logprobs(varied_model, history, output)
                diffs += [abs(a - b) for a, b in zip(output.logprobs, hf, strict=True)]
            user_turns = make_prompts([3, 6, 2], seed=10 + turn)
            histories = [h + o.token_ids + u for h, o, u in zip(histories, outputs, user_turns, strict=True)]
        assert max(diffs) < 1e-4
        assert cached.prefix_cache_queries == 9 and cached.prefix_cache_hits == 6
        # Each hit reuses the previous turn's prompt plus all but the last completion token.
        assert cached.prefix_cache_hit_tokens > 0.5 * cached.prefix_cache_query_tokens
        assert uncached.prefix_cache_hits == uncached.prefix_cache_queries == 0
    finally:
        await cached.shutdown()
        await uncached.shutdown()


async def test_prefix_cache_identical_prompt_and_partial_overlap(engine):
    prompt = make_prompts([30], seed=4)[0]
    first = await engine.generate(request(prompt))
    # The same prompt again: all but its last token come from the cache.
    again = await engine.generate(request(prompt))
    assert again.token_ids == first.token_ids
    assert engine.prefix_cache_hits == 1 and engine.prefix_cache_hit_tokens == len(prompt) - 1
    # A prompt that diverges halfway reuses the common half only.
    branch = prompt[:15] + make_prompts([10], seed=5)[0]
    reference = TorchEngine(copy.deepcopy(engine.model), max_batch_size=1, enable_prefix_caching=False)
    try:
        assert (await engine.generate(request(branch))).token_ids == (
            await reference.generate(request(branch))
        ).token_ids
    finally:
        await reference.shutdown()
    assert engine.prefix_cache_hit_tokens == len(prompt) - 1 + 15


async def test_samples_of_one_prompt_admitted_together_share_its_prefill(varied_model):
    """A group's samples (separate seeded requests) admitted in one step: the first of each prompt runs it,
    the others copy its keys and values and run its last token only. Their tokens equal an engine's without
    prefix caching, seed for seed, and their logprobs HF's."""
    shared = TorchEngine(copy.deepcopy(varied_model), max_batch_size=8, max_model_len=256)
    alone = TorchEngine(
        copy.deepcopy(varied_model), max_batch_size=8, max_model_len=256, enable_prefix_caching=False
    )
    a, b = make_prompts([17, 9], seed=6)
    requests = [
        request(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=seed), f"r{seed}")
        for seed, prompt in enumerate([a] * 6 + [b] * 2)
    ]
    try:
        await shared.pause("keep")
        tasks = [asyncio.create_task(shared.generate(r)) for r in requests]
        await wait_until(lambda: shared.num_waiting == len(requests), "the requests queue")
        await shared.resume()
        outputs = await asyncio.gather(*tasks)
        expected = [await alone.generate(r) for r in requests]  # one at a time: nothing shared
    finally:
        await shared.shutdown()
        await alone.shutdown()
    assert shared.shared_prompt_tokens == 5 * (len(a) - 1) + (len(b) - 1)
    assert alone.shared_prompt_tokens == 0
    assert len({tuple(o.token_ids) for o in outputs}) > 2, (
        "the seeds drew alike: the check below means little"
    )
    for r, output, reference in zip(requests, outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids, r.request_id
        hf = hf_logprobs(varied_model, r.prompt_token_ids, output)
        assert max(abs(x - y) for x, y in zip(output.logprobs, hf, strict=True)) < 1e-4, r.request_id


async def test_prefix_cache_evicts_least_recently_used_and_resets(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=2, max_model_len=128)
    try:
        a, b, c = make_prompts([10, 10, 10], seed=6)
        for prompt in (a, b, c):  # two slots: c evicts a, the least recently used
            await engine.generate(request(prompt))
        assert engine.prefix_cache_hits == 0
        await engine.generate(request([*a, 5]))
        assert engine.prefix_cache_hits == 0  # a was evicted; a+[5] now evicts b
        await engine.generate(request([*c, 5]))
        assert engine.prefix_cache_hits == 1
        assert await engine.reset_prefix_cache() is True
        await engine.generate(request([*c, 5, 6]))
        assert engine.prefix_cache_hits == 1
    finally:
        await engine.shutdown()


async def test_load_weights_drops_cached_prefixes(engine, tiny_model):
    prompt = make_prompts([12], seed=7)[0]
    await engine.generate(request(prompt))
    await engine.load_weights(tiny_model.state_dict().items(), policy_version=1)
    after = await engine.generate(request(prompt))
    assert engine.prefix_cache_hits == 0
    reference = TorchEngine(copy.deepcopy(tiny_model), max_batch_size=1, enable_prefix_caching=False)
    try:
        assert after.token_ids == (await reference.generate(request(prompt))).token_ids
    finally:
        await reference.shutdown()


async def test_a_request_kept_through_a_weight_update_leaves_no_cached_prefix(engine, tiny_model):
    """Its keys and values were computed partly under the old weights: a later request with the same prompt
    must prefill afresh under the new ones (and so sample exactly what a fresh engine would)."""
    prompt = make_prompts([12], seed=8)[0]
    generated_before = engine.total_generated_tokens
    kept = asyncio.create_task(
        # 400 tokens: the pause must reach the engine before the request ends, even on a loaded machine.
        engine.generate(request(prompt, SamplingParams(max_tokens=400, temperature=0.0)))
    )
    await wait_until(
        lambda: engine.total_generated_tokens - generated_before >= 3, "some tokens are sampled", poll_s=0.001
    )
    await engine.pause("keep")
    await engine.load_weights(tiny_model.state_dict().items(), policy_version=1)
    await engine.resume()
    spanning = await asyncio.wait_for(kept, 60)
    assert set(spanning.policy_versions) == {0, 1}
    hits = engine.prefix_cache_hits
    after = await engine.generate(request(prompt))
    assert engine.prefix_cache_hits == hits, "the kept request's keys and values were reused"
    reference = TorchEngine(copy.deepcopy(tiny_model), max_batch_size=1, enable_prefix_caching=False)
    try:
        fresh = await reference.generate(request(prompt))
        assert after.token_ids == fresh.token_ids
        assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    finally:
        await reference.shutdown()


async def test_abort_by_request_id_returns_partials(varied_model):
    engine = TorchEngine(copy.deepcopy(varied_model), max_batch_size=1, max_model_len=512)
    try:
        long = SamplingParams(max_tokens=400)
        running = asyncio.create_task(engine.generate(request([5, 6], long, request_id="run")))
        waiting = asyncio.create_task(engine.generate(request([7, 8], long, request_id="wait")))
        await wait_until(lambda: engine.total_generated_tokens >= 2, "the first request is sampling")
        assert await engine.abort(["nope"]) == 0
        assert await engine.abort(["run", "wait"]) == 2
        running_output, waiting_output = await asyncio.gather(running, waiting)
        assert running_output.finish_reason == waiting_output.finish_reason == FinishReason.ABORT
        assert len(running_output.token_ids) > 0 and waiting_output.token_ids == []
        assert engine.num_running == engine.num_waiting == 0
    finally:
        await engine.shutdown()
