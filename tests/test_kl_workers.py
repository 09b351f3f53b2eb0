"""A KL penalty with ``trainer.num_workers = 2``: each rank holds the reference policy (sharded like the policy
under FSDP2, a replica under DDP), and the steps match the single trainer's, resumed checkpoints included."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.config import TrainerConfig
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer
from rollflow.train.workers import TrainerWorkers

from .helpers.training import make_batch
from .helpers.workers import PARITY, WEIGHT_PARITY, spec

KL = {"kl_coef": 0.5, "lr": 1e-3}  # large enough that the second step's KL is well above PARITY


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def train_both(workers: TrainerWorkers, single: Trainer, batch, step: int, first: bool = False) -> dict:
    """One step on both; the metrics and the weights after it must match. Returns the workers' metrics."""
    config = TrainerConfig(micro_batch_size=3, num_workers=2)
    packed = pack_for_trainer(batch, config, 2)
    expected = single.train_step(pack_for_trainer(batch, single.config, 1), policy_version=step)
    actual = workers.train_step(packed, policy_version=step)
    assert actual.updated and expected.updated
    names = ["loss", "grad_norm", "kl", "entropy", "ratio_mean"]
    if single.config.kl_in == "reward":
        names += ["kl_reward_penalty_mean", "advantage_abs_mean"]
    for name in names:
        assert actual.metrics[name] == pytest.approx(expected.metrics[name], rel=0, abs=PARITY), (step, name)
    full = dict(workers.named_weights())
    for name, tensor in single.named_weights():
        atol = WEIGHT_PARITY if first else 10 * WEIGHT_PARITY  # as test_trainer_workers' assert_parity
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=atol, msg=name)
    return actual.metrics


def split_groups(batch, workers: TrainerWorkers) -> set[int]:
    """Prompt groups whose samples the packer put on both ranks."""
    packed = pack_for_trainer(batch, TrainerConfig(micro_batch_size=3, num_workers=2), 2)
    on_rank = [{sample.prompt_index for sample in rank.samples} for rank in packed.ranks]
    return on_rank[0] & on_rank[1]


@pytest.mark.slow
@pytest.mark.parametrize(("parallelism", "kl_in"), [("fsdp2", "loss"), ("ddp", "loss"), ("fsdp2", "reward")])
def test_workers_with_a_kl_penalty_train_as_one_trainer_and_resume_against_the_initial_reference(
    tiny_model_dir, base_model, tmp_path, parallelism, kl_in
):
    options = {**KL, "parallelism": parallelism, "kl_in": kl_in}
    single = Trainer(copy.deepcopy(base_model), **spec(None, **options).trainer_kwargs())
    assert single.reference_model is not None
    workers = TrainerWorkers(spec(tiny_model_dir, num_workers=2, **options))
    try:
        batches = [make_batch(base_model, seed=seed, groups=4, group_size=3) for seed in (1, 2, 3)]
        if kl_in == "reward":
            # The advantages of a group split over both ranks need the other rank's samples.
            assert split_groups(batches[0], workers)
        first = train_both(workers, single, batches[0], 0, first=True)
        assert first["kl"] == pytest.approx(0.0, abs=1e-7), "the policy starts as the reference"
        second = train_both(workers, single, batches[1], 1)
        assert second["kl"] > 10 * PARITY

        # Resume from the workers' sharded checkpoint in both: the reference stays the initial model (a
        # reference taken from the checkpoint would give a KL of 0 on the next step).
        workers.save_checkpoint(tmp_path / "checkpoint")
        resumed = Trainer(copy.deepcopy(base_model), **spec(None, **options).trainer_kwargs())
        resumed.load_checkpoint(tmp_path / "checkpoint")
        workers.train_step(pack_for_trainer(batches[2], TrainerConfig(micro_batch_size=3, num_workers=2), 2))
        workers.load_checkpoint(tmp_path / "checkpoint")  # back to the checkpoint, past a step after it
        after_resume = train_both(workers, resumed, batches[2], 2)
        assert after_resume["kl"] > 10 * PARITY
    finally:
        workers.close()
