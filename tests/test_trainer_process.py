"""``trainer.placement = "process"``: the trainer in a real child process, against the in-process trainer."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow import Orchestrator
from rollflow.config import TrainerConfig
from rollflow.errors import CheckpointError
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.process import TrainerProcess, TrainerProcessError, TrainerSpec
from rollflow.train.trainer import Trainer

from .helpers.runs import read_jsonl, small_config
from .helpers.training import make_batch


def spec(model_dir, **config) -> TrainerSpec:
    return TrainerSpec(
        model_dir=model_dir,
        config=TrainerConfig(**config),
        temperature=1.0,
        pad_token_id=0,
        seed=0,
        off_policy="none",
    )


@pytest.fixture(scope="module")
def trainer_process(tiny_model_dir):
    trainer = TrainerProcess(spec(tiny_model_dir, lr=1e-2))
    yield trainer
    trainer.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_the_child_trains_exactly_as_the_trainer_in_this_process(tiny_model_dir):
    in_process = Trainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), **spec(tiny_model_dir).trainer_kwargs()
    )
    child = TrainerProcess(spec(tiny_model_dir))
    try:
        assert child.pid != os.getpid() and alive(child.pid)
        shared = dict(child.named_weights())
        before = {name: tensor.clone() for name, tensor in shared.items()}
        assert shared.keys() == dict(in_process.named_weights()).keys()
        for step, seed in enumerate((0, 1), start=1):
            batch = pack_for_trainer(make_batch(in_process.model, seed=seed), in_process.config)
            expected, actual = (
                in_process.train_step(batch, policy_version=step),
                child.train_step(batch, step),
            )
            assert actual.updated and actual.step == expected.step
            assert actual.metrics.keys() == expected.metrics.keys()
            for name in ("loss", "grad_norm", "entropy", "num_loss_tokens"):
                assert actual.metrics[name] == pytest.approx(expected.metrics[name], rel=1e-6), name
        # The weights the parent maps are the child's live ones: updated in place, without a copy.
        assert any(not torch.equal(shared[name], before[name]) for name in shared)
        for name, tensor in in_process.named_weights():
            torch.testing.assert_close(shared[name], tensor, rtol=0, atol=1e-6)
    finally:
        child.close()
    assert not alive(child.pid)
    child.close()  # idempotent


@pytest.mark.slow
def test_checkpoints_save_and_load_through_the_child(trainer_process, tiny_model_dir, tmp_path):
    batch = pack_for_trainer(
        make_batch(AutoModelForCausalLM.from_pretrained(tiny_model_dir)), TrainerConfig()
    )
    trainer_process.train_step(batch)
    saved = {name: tensor.clone() for name, tensor in trainer_process.named_weights()}
    trainer_process.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    trainer_process.train_step(batch)
    assert any(not torch.equal(t, saved[n]) for n, t in trainer_process.named_weights())
    trainer_process.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in trainer_process.named_weights():
        assert torch.equal(tensor, saved[name]), name


def test_the_child_is_a_trainer_handle_and_runs_weight_pushes_next_to_its_weights(trainer_process):
    from rollflow.train.handle import TrainerHandle

    from .helpers.workers import count_weights

    assert isinstance(trainer_process, TrainerHandle) and trainer_process.world_size == 1
    expected = sum(float(tensor.double().sum()) for _, tensor in trainer_process.named_weights())
    rank, total, every_rank = trainer_process.push_weights(count_weights)
    assert rank == 0 and every_rank == [(0, total)] and total == pytest.approx(expected, rel=1e-12)


def test_an_error_in_the_child_is_raised_here_and_the_child_serves_on(
    trainer_process, tiny_model_dir, tmp_path
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    bad = pack_for_trainer(make_batch(model), TrainerConfig())  # the packer checks samples: spoil one after
    bad.ranks[0].micro_batches[0][0].sample.logprobs.append(-1.0)  # one logprob more than completion tokens
    with pytest.raises(ValueError, match="logprobs") as raised:
        trainer_process.train_step(bad)
    assert any("raised in the trainer process" in note for note in raised.value.__notes__)
    with pytest.raises(CheckpointError, match="incomplete or not a rollflow checkpoint"):
        trainer_process.load_checkpoint(tmp_path / "nothing-here")
    assert trainer_process.train_step(pack_for_trainer(make_batch(model), TrainerConfig())).updated


@pytest.mark.slow
def test_a_child_that_dies_fails_the_next_call_clearly(tiny_model_dir):
    child = TrainerProcess(spec(tiny_model_dir))
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(TrainerProcessError, match=r"exited \(exit code -9\) during train_step"):
        child.train_step(
            pack_for_trainer(
                make_batch(AutoModelForCausalLM.from_pretrained(tiny_model_dir)), TrainerConfig()
            )
        )
    child.close()


@pytest.mark.slow
def test_a_trainer_that_cannot_be_built_fails_start_up_and_leaves_no_process(tmp_path):
    before = _children()
    with pytest.raises(Exception, match=str(tmp_path / "missing")) as raised:
        TrainerProcess(spec(tmp_path / "missing"))
    assert any("raised in the trainer process" in note for note in raised.value.__notes__)
    assert _children() - before == set()


def _children() -> set[int]:
    """Live child processes of this one (multiprocessing's resource tracker may come and go; it is left out)."""
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.slow
@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_a_fully_async_run_trains_in_the_child_and_resumes(tmp_path):
    config = small_config(
        tmp_path,
        "orchestrator.mode='fully_async'",
        "orchestrator.steps=3",
        "trainer.placement='process'",
        "checkpoint.every=2",
    )
    async with Orchestrator(config) as orchestrator:
        assert isinstance(orchestrator.trainer, TrainerProcess)
        pid = orchestrator.trainer.pid
        first = await orchestrator.run(steps=2)
    assert not alive(pid)  # stop() ended the child
    assert [m["step"] for m in first] == [1, 2]
    assert orchestrator.state.policy_version == 2
    assert all(m["num_samples"] == 16 and m["staleness_max"] <= 1 for m in first)

    async with Orchestrator(config, resume=True) as resumed:
        assert resumed.state.step == 2
        rest = await resumed.run()
    assert [m["step"] for m in rest] == [3]
    steps = [m["step"] for m in read_jsonl(config.run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    trained = [r["prompt_index"] for r in read_jsonl(config.run_dir / "rollouts.jsonl")]
    assert len(trained) == len(set(trained)) == 12  # every prompt once, across the resume
    assert json.loads((config.run_dir / "config.json").read_text())["trainer"]["placement"] == "process"
