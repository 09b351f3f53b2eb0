"""``rollflow export``: a checkpoint as a standalone HF model directory that loads with ``from_pretrained`` and
generates what rollflow's engine generates; bad runs, steps and outputs are refused clearly."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflow.cli import main
from rollflow.inference.engine import TorchEngine
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.checkpoint import STATE_FILE, OrchestratorState
from rollflow.train.trainer import OPTIMIZER_FILE

from .helpers.training import make_batch, make_trainer

STEPS = (1, 2)


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A run directory with checkpoints of steps 1 and 2 of a trainer on the tiny model with re-drawn, larger
    weights (the random-init tiny model repeats one token greedily, which would make any export agree)."""
    model = load_causal_lm(tiny_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3, generator=generator)
    trainer = make_trainer(model, lr=1e-2)
    run = tmp_path_factory.mktemp("run")
    for step in STEPS:
        assert trainer.train_step(make_batch(trainer.model, seed=step)).updated
        checkpoint = run / "checkpoints" / f"step_{step:06d}"
        trainer.save_checkpoint(checkpoint)
        (checkpoint / STATE_FILE).write_bytes(
            msgspec.json.encode(OrchestratorState(step=step, policy_version=step))
        )
    return run, copy.deepcopy(trainer.model).eval()


def rollflow_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow", "export", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


async def engine_greedy(model, prompt: list[int], stop: tuple[int, ...]) -> list[int]:
    engine = TorchEngine(model, max_batch_size=1, max_model_len=256)
    try:
        sampling = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=stop)
        output = await engine.generate(GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
    finally:
        await engine.shutdown()
    return output.token_ids


@pytest.mark.slow
def test_export_loads_with_from_pretrained_and_generates_as_the_engine(trained_run, tmp_path):
    run, trained = trained_run
    out = tmp_path / "model"
    result = rollflow_export(str(run), str(out), "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["event"] == "exported" and line["step"] == STEPS[-1] and line["dtype"] == "float32"
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / OPTIMIZER_FILE).exists() and not list(out.glob("*.pt"))
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())  # readable by a serving user

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    eos = model.generation_config.eos_token_id
    stop = tuple(eos if isinstance(eos, list) else [eos])
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id
        )[0, len(prompt) :].tolist()
    expected = asyncio.run(engine_greedy(trained, prompt, stop))
    assert generated == expected
    assert len(set(expected)) > 1, expected  # a varied continuation, not one repeated token


def test_export_of_an_earlier_step_in_bfloat16(trained_run, tmp_path):
    run, _ = trained_run
    out = tmp_path / "model"
    assert main(["export", str(run), str(out), "--step", "1", "--dtype", "bfloat16"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    step_1 = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000001" / "hf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, step_1.state_dict()[name].to(torch.bfloat16)), name


def test_bad_inputs_are_clear_errors(trained_run, tmp_path, capsys):
    run, _ = trained_run
    assert main(["export", str(tmp_path / "no-run"), str(tmp_path / "a")]) == 1
    assert "no-run does not exist" in capsys.readouterr().err

    assert main(["export", str(run), str(tmp_path / "a"), "--step", "7"]) == 1
    err = capsys.readouterr().err
    assert "--step 7" in err and "it has steps 1, 2" in err

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(occupied)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert (occupied / "keep.txt").read_text() == "mine"
    assert main(["export", str(run), str(occupied), "--force"]) == 0
    assert not (occupied / "keep.txt").exists() and (occupied / "config.json").is_file()

    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert main(["export", str(empty), str(tmp_path / "b")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
