"""Sequence-level ratios and corrections with ``trainer.num_workers = 2`` (real gloo workers): samples of
uneven lengths split across the ranks, the step matches one trainer's within ``PARITY``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rollflow.config import OffPolicyTable, TrainerConfig
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer
from rollflow.train.workers import TrainerWorkers

from .helpers.training import make_behaviour_batch, perturbed
from .helpers.workers import PARITY, WEIGHT_PARITY, spec

# Two passes: the second pass's sequence ratios are against the start of the step and leave 1 (a correction
# anchors the first pass's ratio at exactly 1), and GSPO's small clip range then acts on some sequences.
GSPO = {
    "ratio_level": "sequence",
    "loss_agg": "seq_mean_token_mean",
    "clip_low": 3e-4,
    "clip_high": 4e-4,
    "ppo_epochs": 2,
    "lr": 1e-3,
}
SEQUENCE_MIS = OffPolicyTable(kind="mis", level="sequence", high=1.3)


@pytest.mark.slow
def test_sequence_ratios_and_sequence_masks_on_two_workers_train_as_one_trainer(tiny_model_dir):
    base_model = load_causal_lm(tiny_model_dir)
    sampler = perturbed(base_model, seed=5)  # the batches are off-policy: ratios and weights leave 1
    worker_spec = dataclasses.replace(spec(tiny_model_dir, num_workers=2, **GSPO), off_policy=SEQUENCE_MIS)
    single_spec = dataclasses.replace(spec(None, **GSPO), off_policy=SEQUENCE_MIS)
    single = Trainer(copy.deepcopy(base_model), **single_spec.trainer_kwargs())
    workers = TrainerWorkers(worker_spec)
    try:
        for step, seed in enumerate((11, 12)):
            batch = make_behaviour_batch(sampler, seed=seed, groups=4, group_size=3)
            packed = pack_for_trainer(batch, TrainerConfig(micro_batch_size=3, num_workers=2), 2)
            rank_tokens = [sum(len(s.completion_token_ids) for s in rank.samples) for rank in packed.ranks]
            assert rank_tokens[0] != rank_tokens[1] and min(rank_tokens) > 0, rank_tokens
            expected = single.train_step(pack_for_trainer(batch, single.config, 1), policy_version=1)
            actual = workers.train_step(packed, policy_version=1)
            assert actual.updated and expected.updated
            names = ["ppo_epoch_2/loss", "ppo_epoch_2/clip_fraction", "ppo_epoch_2/ratio_mean"]
            names += [
                "loss",
                "grad_norm",
                "ratio_mean",
                "clip_fraction",
                "is_weight_mean",
                "is_truncated_fraction",
            ]
            names += sorted(name for name in expected.metrics if name.startswith("off_policy/"))
            assert "off_policy/masked_seq_fraction" in names and "off_policy/ratio_p99" in names
            for name in names:
                assert actual.metrics[name] == pytest.approx(expected.metrics[name], rel=0, abs=PARITY), (
                    step,
                    name,
                )
            # The check discriminates: sequences were masked, and the sequence clip acted.
            assert 0 < expected.metrics["off_policy/masked_seq_fraction"] < 1, expected.metrics
            assert expected.metrics["ppo_epoch_2/clip_fraction"] > 0
            assert expected.metrics["ppo_epoch_2/ratio_mean"] != pytest.approx(1.0, abs=1e-6)
            full = dict(workers.named_weights())
            for name, tensor in single.named_weights():
                atol = WEIGHT_PARITY if step == 0 else 10 * WEIGHT_PARITY
                torch.testing.assert_close(full[name], tensor, rtol=0, atol=atol, msg=name)
    finally:
        workers.close()
