"""Why the quickstart with LoRA did not learn, and what makes it learn.

The tiny model is random-init with tied embeddings of std 0.02: every logit is ``norm(h) . E_v``, within about
+-1.3 whatever the hidden state, so its output stays near uniform (entropy ~ ln V) unless the embeddings or the
head change. Adapters on the seven projections cannot change them; an adapter on ``lm_head`` can. The tests
measure that on a supervised stand-in of the case task (the probability mass of letters in the asked case at
the first answer token, gradient descent on it directly), which takes seconds instead of a run; the
``slow`` test runs the quickstart itself with ``examples/quickstart_lora.toml``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollflow.config import LoraConfig, TrainerConfig, load_config
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.rollout.tasks import CaseTask
from rollflow.train.lora import adapter_disabled, apply_lora
from rollflow.train.trainer import Trainer

from .helpers.training import behaviour_logprobs, make_batch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUICKSTART = EXAMPLES / "quickstart.toml"
QUICKSTART_LORA = EXAMPLES / "quickstart_lora.toml"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STAND_IN_STEPS = 30


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def case_prompts(tiny_model_dir):
    """The case task's first 32 prompts, left-padded, and each one's mask of single tokens in the asked case."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = [tokenizer.decode([token]) for token in range(len(tokenizer))]

    def in_case(case: str) -> torch.Tensor:
        wanted = str.isupper if case == "upper" else str.islower
        return torch.tensor(
            [any(c.isalpha() for c in p) and all(wanted(c) for c in p if c.isalpha()) for p in pieces]
        ).float()

    masks = {case: in_case(case) for case in ("upper", "lower")}
    items = [CaseTask(0).item(index) for index in range(32)]
    encoded = [
        tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, return_dict=False)
        for item in items
    ]
    longest = max(map(len, encoded))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (longest - len(e)) + list(e) for e in encoded])
    attention_mask = torch.tensor([[0] * (longest - len(e)) + [1] * len(e) for e in encoded])
    wanted = torch.stack([masks[item.answer] for item in items])
    letters = (masks["upper"] + masks["lower"]).clamp(max=1)
    return input_ids, attention_mask, wanted, letters


def train_stand_in(model, case_prompts, lr: float) -> tuple[float, float]:
    """``STAND_IN_STEPS`` AdamW steps raising the share of the asked case among letters at the first answer
    token; returns that share and the mean entropy there, after the steps."""
    input_ids, attention_mask, wanted, letters = case_prompts
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for step in range(STAND_IN_STEPS + 1):
        logp = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -1].float().log_softmax(-1)
        share = (logp.exp() * wanted).sum(-1) / (logp.exp() * letters).sum(-1)
        if step == STAND_IN_STEPS:
            return share.mean().item(), -(logp.exp() * logp).sum(-1).mean().item()
        optimizer.zero_grad()
        (-share.log().mean()).backward()
        optimizer.step()
    raise AssertionError("unreachable")


def quickstart_lora() -> tuple[LoraConfig, float]:
    config = load_config([QUICKSTART, QUICKSTART_LORA])
    assert config.trainer.lora is not None
    return config.trainer.lora, config.trainer.lr


def test_the_quickstart_lora_recipe_can_move_the_random_init_models_output(base_model, case_prompts):
    lora, lr = quickstart_lora()
    share, entropy = train_stand_in(apply_lora(copy.deepcopy(base_model), lora), case_prompts, lr)
    assert share > 0.9, f"{lora.target_modules} cannot learn the case stand-in: {share}"
    assert entropy < math.log(base_model.config.vocab_size) - 0.3


def test_adapters_on_the_projections_alone_leave_the_output_near_uniform(base_model, case_prompts):
    """The cause: the same recipe without the head's adapter does not move the output at all."""
    lora, lr = quickstart_lora()
    projections_only = LoraConfig(rank=lora.rank, alpha=lora.alpha, target_modules=PROJECTIONS)
    share, entropy = train_stand_in(apply_lora(copy.deepcopy(base_model), projections_only), case_prompts, lr)
    assert share < 0.6
    assert entropy > math.log(base_model.config.vocab_size) - 0.05


@pytest.mark.parametrize("adapter_versions", [0, 3], ids=["merged", "unmerged"])
def test_the_engine_samples_from_the_adapted_model_not_the_base(base_model, adapter_versions):
    """The adapter (the head's included) reaches the engine, merged (sync runs) or unmerged (async runs): its
    logprobs are the trainer's with the adapter on, and far from the trainer's with it off."""
    from rollflow.inference.engine.engine import TorchEngine

    lora, _ = quickstart_lora()
    trainer = Trainer(copy.deepcopy(base_model), TrainerConfig(lr=0.05, lora=lora))
    for seed in range(3):
        batch = pack_for_trainer(make_batch(base_model, seed=seed), trainer.config, 1)
        assert trainer.train_step(batch).updated
    engine = TorchEngine(
        copy.deepcopy(base_model), max_batch_size=4, max_model_len=256, adapter_versions=adapter_versions
    )

    async def sample() -> list:
        await engine.load_weights(list(trainer.named_weights()), policy_version=3)
        try:
            params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
            return [await engine.generate(GenerateRequest([5, 17, 42, 99 + i], params)) for i in range(3)]
        finally:
            await engine.shutdown()

    outputs = asyncio.run(sample())
    model = trainer.model.eval()
    on, off, engine_logprobs = [], [], []
    with torch.no_grad():
        for output, last in zip(outputs, (99, 100, 101), strict=True):
            prompt = [5, 17, 42, last]
            on += behaviour_logprobs(model, prompt, output.token_ids, 1.0)
            with adapter_disabled(model):
                off += behaviour_logprobs(model, prompt, output.token_ids, 1.0)
            engine_logprobs += output.logprobs
    assert all(version == 3 for output in outputs for version in output.policy_versions)
    assert max(abs(a - b) for a, b in zip(engine_logprobs, on, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(engine_logprobs, off, strict=True)) > 0.1


@pytest.mark.slow
def test_the_quickstart_with_lora_reaches_the_reward_bar(tmp_path):
    """``rollflow run examples/quickstart.toml examples/quickstart_lora.toml`` (sync), as a subprocess: the mean
    reward of 10 consecutive steps reaches 0.9 within 90 steps (49 when measured), with the engine's
    logprobs within 1e-4 of the trainer's."""
    command = [sys.executable, "-m", "rollflow", "run", str(QUICKSTART), str(QUICKSTART_LORA)]
    command += ["--no-progress", "--set", "orchestrator.steps=90", "--set", "checkpoint.every=0"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in metrics.splitlines()]
    rewards = [row["reward_mean"] for row in rows]
    windows = [statistics.fmean(rewards[end - 10 : end]) for end in range(10, len(rewards) + 1)]
    assert max(windows) >= 0.9, f"best 10-step mean {max(windows):.3f}"
    assert max(row["logprob_mismatch"] for row in rows) < 1e-4
