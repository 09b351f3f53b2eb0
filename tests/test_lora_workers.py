"""``[trainer.lora]`` on 2 data-parallel workers (real processes, a real gloo group) against one trainer: the
same adapter at the start (seeded), the same loss and gradient norm each step, the same adapter pushed."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.config import LoraConfig, TrainerConfig
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer
from rollflow.train.workers import TrainerWorkers

from .helpers.training import make_batch
from .helpers.workers import spec

LORA = LoraConfig(rank=4, alpha=8.0)
RELATIVE = 1e-5  # loss and grad norm, 2 workers against 1


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_two_lora_workers_step_as_one_trainer(parallelism, tiny_model_dir):
    base = load_causal_lm(tiny_model_dir)
    config = {"lora": LORA, "kl_coef": 0.01, "logprob_chunk_tokens": 16}
    single = Trainer(copy.deepcopy(base), **spec(None, **config).trainer_kwargs())
    workers = TrainerWorkers(spec(tiny_model_dir, num_workers=2, parallelism=parallelism, **config))
    try:
        start = dict(workers.named_weights())
        for name, tensor in single.named_weights():  # the seeded initial adapter, on every rank
            torch.testing.assert_close(start[name], tensor, rtol=0, atol=0, msg=name)
        for step, seed in enumerate((1, 2)):
            batch = make_batch(base, seed=seed)
            expected = single.train_step(pack_for_trainer(batch, single.config, 1), policy_version=step)
            actual = workers.train_step(
                pack_for_trainer(batch, TrainerConfig(micro_batch_size=3, num_workers=2), 2),
                policy_version=step,
            )
            assert actual.updated and expected.updated
            for name in ("loss", "grad_norm"):
                assert actual.metrics[name] == pytest.approx(expected.metrics[name], rel=RELATIVE), (
                    step,
                    name,
                )
        pushed = dict(workers.named_weights())
        assert pushed.keys() == dict(single.named_weights()).keys()
        assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in pushed)
    finally:
        workers.close()


@pytest.mark.slow
def test_lora_checkpoints_resume_across_worker_counts(tiny_model_dir, tmp_path):
    """2 fsdp2 workers write a checkpoint (the adapter's DCP shards and the PEFT directory), a single trainer
    resumes it; the single trainer's checkpoint resumes on the workers. The next step agrees each time."""
    base = load_causal_lm(tiny_model_dir)
    config = {"lora": LORA}
    workers = TrainerWorkers(spec(tiny_model_dir, num_workers=2, parallelism="fsdp2", **config))
    packed_for = TrainerConfig(micro_batch_size=3, num_workers=2)
    try:
        assert workers.train_step(pack_for_trainer(make_batch(base, seed=1), packed_for, 2)).updated
        workers.save_checkpoint(tmp_path / "workers")
        assert (tmp_path / "workers" / "adapter" / "adapter_model.safetensors").is_file()
        assert not (tmp_path / "workers" / "model.safetensors").exists()

        single = Trainer(copy.deepcopy(base), **spec(None, **config).trainer_kwargs())
        single.load_checkpoint(tmp_path / "workers")
        gathered = dict(workers.named_weights())
        for name, tensor in single.named_weights():
            torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0, msg=name)
        batch = make_batch(base, seed=2)
        expected = single.train_step(pack_for_trainer(batch, single.config, 1))
        actual = workers.train_step(pack_for_trainer(batch, packed_for, 2))
        for name in ("loss", "grad_norm"):  # the optimizer state came along: the same update
            assert actual.metrics[name] == pytest.approx(expected.metrics[name], rel=RELATIVE), name

        single.save_checkpoint(tmp_path / "single")
        workers.load_checkpoint(tmp_path / "single")
        gathered = dict(workers.named_weights())
        for name, tensor in single.named_weights():
            torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0, msg=name)
    finally:
        workers.close()
