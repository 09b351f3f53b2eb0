"""The trainer and the torch engine on a CUDA GPU (``nox -s gpu_tests``): a bf16 step with gradient
checkpointing whose peak memory is held to an estimate, float32 steps that equal the CPU's, and the engine
generating on the GPU with the logprobs of a Hugging Face forward."""

from __future__ import annotations

import asyncio
import copy
import gc
import math

import pytest
import torch

from rollflow.config import TrainerConfig
from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch

from .helpers.training import PackingTrainer, assert_same_first_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Big enough that activations, not the tiny model's weights, decide peak memory; small enough for any GPU.
ARCHITECTURE = dict(
    vocab_size=32_000,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
BATCH, TOKENS, CHUNK = 8, 1024, 1024


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**ARCHITECTURE)).eval()


def _batch(vocab: int, samples: int = BATCH, tokens: int = TOKENS, prompt: int = 16) -> TrainBatch:
    generator = torch.Generator().manual_seed(0)
    group = []
    for index in range(samples):
        ids = torch.randint(0, vocab, (tokens,), generator=generator).tolist()
        group.append(
            Sample(
                prompt_index=0,
                sample_index=index,
                prompt_token_ids=ids[:prompt],
                completion_token_ids=ids[prompt:],
                logprobs=[-math.log(vocab)] * (tokens - prompt),  # about a random model's
                policy_versions=[0] * (tokens - prompt),
                finish_reason=FinishReason.LENGTH,
                reward=float(index % 2),
            )
        )
    return TrainBatch(step=0, groups=[ScoredGroup(prompt_index=0, samples=group)])


def _peak_step_bytes(model, batch: TrainBatch, **config) -> int:
    """Peak CUDA memory of building a trainer for ``model`` (on the CPU) and one step, above what was there."""
    gc.collect()  # an earlier trainer's reference cycles must not count against this one
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = PackingTrainer(
        model,
        TrainerConfig(device="cuda", micro_batch_size=BATCH, logprob_chunk_tokens=CHUNK, **config),
        pad_token_id=0,
    )
    result = trainer.train_step(batch)
    torch.cuda.synchronize()
    assert result.updated and result.metrics["grad_norm"] > 0
    peak = torch.cuda.max_memory_allocated() - baseline
    del trainer, result
    return peak


def _estimate_bf16_checkpointed_bytes(params: int) -> int:
    """Upper estimate of a bf16-autocast, gradient-checkpointed step's peak, from the shapes alone."""
    hidden, inter, layers = ARCHITECTURE["hidden_size"], ARCHITECTURE["intermediate_size"], 8
    tokens = BATCH * TOKENS
    master_state = 16 * params  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq
    optimizer_temporaries = 4 * params  # foreach AdamW's intermediate (sqrt of exp_avg_sq) over all params
    bf16_weight_copies = 2 * params  # autocast's cast of each weight, cached for the forward
    layer_inputs = layers * tokens * hidden * 4  # what checkpointing keeps: each layer's float32 input
    # One layer recomputed in the backward: attention (q, k, v, o, norms) and the MLP (gate, up, act, product)
    # in bf16 and float32, and their gradients, bounded generously.
    one_layer = tokens * (16 * hidden + 6 * inter) * 4
    logits_chunks = 3 * CHUNK * ARCHITECTURE["vocab_size"] * 4  # a chunk's logits, probabilities, gradient
    return (
        master_state + optimizer_temporaries + bf16_weight_copies + layer_inputs + one_layer + logits_chunks
    )


def test_bf16_step_with_gradient_checkpointing_peaks_within_the_estimate():
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    batch = _batch(ARCHITECTURE["vocab_size"])
    checkpointed = _peak_step_bytes(
        copy.deepcopy(model), batch, dtype="bfloat16", gradient_checkpointing=True
    )
    plain = _peak_step_bytes(copy.deepcopy(model), batch, dtype="bfloat16", gradient_checkpointing=False)
    estimate = _estimate_bf16_checkpointed_bytes(params)
    print(
        f"params {params / 1e6:.1f}M: peak {checkpointed / 2**30:.2f} GiB with checkpointing, "
        f"{plain / 2**30:.2f} GiB without, estimate {estimate / 2**30:.2f} GiB"
    )
    assert 16 * params <= checkpointed <= estimate  # the float32 master state is there, and not much more
    assert checkpointed < plain  # checkpointing is in effect


def test_float32_step_on_cuda_equals_the_cpu_step():
    model = _model()
    batch = _batch(ARCHITECTURE["vocab_size"], samples=4, tokens=128)
    metrics, trainers = {}, {}
    for device in ("cpu", "cuda"):
        trainer = PackingTrainer(
            copy.deepcopy(model),
            TrainerConfig(device=device, dtype="float32", logprob_chunk_tokens=100),
            pad_token_id=0,
        )
        assert next(trainer.model.parameters()).device.type == device
        metrics[device] = trainer.train_step(batch).metrics
        trainers[device] = trainer
    assert metrics["cuda"]["loss"] == pytest.approx(metrics["cpu"]["loss"], abs=1e-5)
    assert metrics["cuda"]["grad_norm"] == pytest.approx(metrics["cpu"]["grad_norm"], rel=1e-4)
    # Float32 kernels sum in another order on the GPU: gradients agree to float rounding, not bit for bit.
    assert_same_first_step(trainers["cuda"], trainers["cpu"], grad_atol=1e-4, weight_atol=1e-5)


def test_engine_generates_on_cuda_with_hf_logprobs(tiny_model_dir):
    from rollflow.inference.engine import TorchEngine
    from rollflow.messages import GenerateRequest, SamplingParams
    from rollflow.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir, device="cuda")
    reference = copy.deepcopy(model)
    prompts = [[5, 17, 9, 30], list(range(40, 63)), [7]]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)

    async def generate():
        engine = TorchEngine(model, max_batch_size=4, max_model_len=256)
        try:
            return await asyncio.gather(
                *(engine.generate(GenerateRequest(prompt_token_ids=p, sampling=params)) for p in prompts)
            )
        finally:
            await engine.shutdown()

    outputs = asyncio.run(generate())
    diffs = []
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.token_ids) == len(output.logprobs) == 16
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output.token_ids], device="cuda")).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        expected = logprobs.gather(1, torch.tensor(output.token_ids, device="cuda")[:, None])[:, 0].tolist()
        diffs += [abs(a - b) for a, b in zip(output.logprobs, expected, strict=True)]
    assert sum(diffs) / len(diffs) < 1e-4
