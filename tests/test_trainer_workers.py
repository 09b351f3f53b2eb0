"""``trainer.num_workers = 2``: real worker processes in a real gloo group, against the single trainer.

One FSDP2 group serves most tests (module-scoped, in test order); the DDP group is killed by its own test.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollflow.config import TrainerConfig
from rollflow.errors import CheckpointError, ConfigError
from rollflow.messages import TrainBatch
from rollflow.models.loading import load_causal_lm
from rollflow.orchestrator.packing import pack_for_trainer, sample_length
from rollflow.train.handle import TrainerHandle
from rollflow.train.trainer import Trainer
from rollflow.train.workers import TrainerWorkerError, TrainerWorkers, _check_devices

from .helpers.training import make_batch
from .helpers.workers import PARITY, WEIGHT_PARITY, count_weights, spec


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def fsdp2_workers(tiny_model_dir):
    workers = TrainerWorkers(spec(tiny_model_dir, num_workers=2, parallelism="fsdp2"))
    yield workers
    workers.close()


def one_sample_batch(model) -> TrainBatch:
    """A step with a single trainable sample: one rank trains it, the other only an empty micro-batch."""
    batch = make_batch(model, seed=9, groups=1, group_size=2)
    batch.groups[0].samples[1].masked = True
    return batch


def assert_parity(
    workers: TrainerWorkers, single: Trainer, batches: list[TrainBatch], fresh: bool = False
) -> None:
    """Train both on the same batches; ``fresh``: both start from the model's initial weights."""
    for step, batch in enumerate(batches):
        packed = pack_for_trainer(batch, workers_config(workers), 2)
        lengths = [sum(sample_length(s) for s in rank.samples) for rank in packed.ranks]
        assert packed.metrics["num_micro_batches"] >= 1
        expected = single.train_step(pack_for_trainer(batch, single.config, 1), policy_version=step)
        actual = workers.train_step(packed, policy_version=step)
        assert actual.updated and expected.updated and actual.step == expected.step
        for name in ("loss", "grad_norm", "entropy", "logprob_mismatch", "ratio_mean"):
            assert actual.metrics[name] == pytest.approx(
                expected.metrics[name], rel=0, abs=PARITY, nan_ok=True
            ), (step, name, lengths)
        assert actual.metrics["num_loss_tokens"] == expected.metrics["num_loss_tokens"]
        assert actual.metrics.keys() == expected.metrics.keys() | {
            "num_micro_batches",
            "rank_token_imbalance",
        }
        full = dict(workers.named_weights())
        for name, tensor in single.named_weights():
            # After the first step from the same weights: within WEIGHT_PARITY. Later, AdamW's m / sqrt(v) of
            # a near-zero gradient keeps amplifying float noise (by up to the learning rate per step), so
            # the loss and gradient norm above are the check; the weights only within 10x.
            atol = WEIGHT_PARITY if step == 0 and fresh else 10 * WEIGHT_PARITY
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=atol, msg=name)


def workers_config(workers: TrainerWorkers) -> TrainerConfig:
    return TrainerConfig(micro_batch_size=3, num_workers=workers.world_size)


@pytest.mark.slow
def test_the_handles_satisfy_the_protocol(fsdp2_workers, base_model):
    assert isinstance(fsdp2_workers, TrainerHandle)
    assert isinstance(Trainer(copy.deepcopy(base_model), TrainerConfig()), TrainerHandle)
    assert fsdp2_workers.world_size == 2 and all(alive(pid) for pid in fsdp2_workers.pids)


def test_fsdp2_workers_train_as_one_trainer(fsdp2_workers, base_model):
    single = Trainer(copy.deepcopy(base_model), **spec(None).trainer_kwargs())
    assert dict(fsdp2_workers.named_weights()).keys() == dict(single.named_weights()).keys()
    # Uneven lengths per rank; then a step where one rank has only an empty micro-batch (zero loss).
    assert_parity(
        fsdp2_workers, single, [make_batch(base_model, seed=1), one_sample_batch(base_model)], fresh=True
    )


def test_push_weights_runs_on_every_rank_with_its_shards(fsdp2_workers):
    expected = sum(float(t.double().sum()) for _, t in fsdp2_workers.named_weights())
    rank, total, every_rank = fsdp2_workers.push_weights(count_weights)
    assert (rank, total) == every_rank[0], "the handle returns rank 0's result"
    assert [r for r, _ in every_rank] == [0, 1]
    for _, rank_total in every_rank:
        assert rank_total == pytest.approx(expected, rel=1e-9)


def test_the_value_probe_of_sharded_workers_is_the_single_trainers_on_the_same_weights(
    fsdp2_workers, base_model
):
    """``probe_logprobs`` (the value proof of adapters pushed into vLLM) runs the sharded forward on every
    rank and answers what one trainer holding the same weights computes."""
    single = Trainer(copy.deepcopy(base_model), **spec(None).trainer_kwargs())
    single.model.load_state_dict(dict(fsdp2_workers.named_weights()))
    token_ids = [1, 17, 123, 4, 256, 9, 42, 500, 7, 3]
    probed = fsdp2_workers.probe_logprobs(token_ids, 8)
    assert len(probed) == 2 and all(value < 0 for value in probed)
    assert probed == pytest.approx(single.probe_logprobs(token_ids, 8), abs=1e-5)
    with pytest.raises(ValueError, match=r"start must be within 1 \.\. 10"):
        single.probe_logprobs(token_ids, 0)


def test_sharded_checkpoints_resume_on_another_number_of_workers(fsdp2_workers, base_model, tmp_path):
    fsdp2_workers.save_checkpoint(tmp_path / "two")
    assert (tmp_path / "two" / "trainer_state" / ".metadata").is_file()
    assert (tmp_path / "two" / "model.safetensors").is_file()
    saved = {name: tensor.clone() for name, tensor in fsdp2_workers.named_weights()}

    # 2 -> 1: a single trainer loads the shards, optimizer state included: the next step matches.
    single = Trainer(copy.deepcopy(base_model), **spec(None).trainer_kwargs())
    single.load_checkpoint(tmp_path / "two")
    for name, tensor in single.named_weights():
        assert torch.equal(tensor, saved[name]), name
    assert_parity(fsdp2_workers, single, [make_batch(base_model, seed=2)])

    # 1 -> 2: the workers load a single trainer's checkpoint (full weights, indexed optimizer state).
    single.save_checkpoint(tmp_path / "one")
    after_one = {name: tensor.clone() for name, tensor in single.named_weights()}
    fsdp2_workers.load_checkpoint(tmp_path / "two")  # back to the older state first, so the load shows
    fsdp2_workers.load_checkpoint(tmp_path / "one")
    for name, tensor in fsdp2_workers.named_weights():
        assert torch.equal(tensor, after_one[name]), name
    assert_parity(fsdp2_workers, single, [make_batch(base_model, seed=3)])


def test_a_bad_checkpoint_fails_on_every_rank_and_the_group_serves_on(fsdp2_workers, base_model, tmp_path):
    with pytest.raises(CheckpointError, match="not a rollflow checkpoint") as raised:
        fsdp2_workers.load_checkpoint(tmp_path / "nothing")
    assert any("raised in trainer worker rank 0" in note for note in raised.value.__notes__)
    # Another model's checkpoint (here: one tensor of another shape) is refused before anything loads.
    other = Trainer(copy.deepcopy(base_model), TrainerConfig())
    other.save_checkpoint(tmp_path / "other")
    weights = load_file(tmp_path / "other" / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, tmp_path / "other" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"wrong shape \['model\.norm\.weight \(3,\)"):
        fsdp2_workers.load_checkpoint(tmp_path / "other")
    assert fsdp2_workers.train_step(
        pack_for_trainer(make_batch(base_model, seed=4), workers_config(fsdp2_workers), 2)
    )


def fail_on_rank_1(rank, named_weights):
    """Rank 1 raises; rank 0 goes on into the gathers rank 1 never joins."""
    if rank == 1:
        raise RuntimeError("out of memory on rank 1")
    return count_weights(rank, named_weights)


@pytest.mark.slow
def test_an_error_on_one_rank_while_another_waits_in_a_collective_stops_the_group(fsdp2_workers, monkeypatch):
    """Last of the tests on the shared group: it ends it."""
    monkeypatch.setattr("rollflow.train.workers.ERROR_GRACE_S", 1.0)
    pids = fsdp2_workers.pids
    with pytest.raises(RuntimeError, match="out of memory on rank 1") as raised:
        fsdp2_workers.push_weights(fail_on_rank_1)
    assert any("raised in trainer worker rank 1" in note for note in raised.value.__notes__)
    assert not any(alive(pid) for pid in pids), "the stuck rank is stopped too"
    with pytest.raises(TrainerWorkerError, match="stopped: rank 1 raised RuntimeError during push_weights"):
        fsdp2_workers.push_weights(count_weights)


@pytest.mark.slow
def test_ddp_workers_train_as_one_trainer_and_a_dead_worker_ends_the_step(tiny_model_dir, base_model):
    workers = TrainerWorkers(spec(tiny_model_dir, num_workers=2, parallelism="ddp"))
    try:
        single = Trainer(copy.deepcopy(base_model), **spec(None).trainer_kwargs())
        assert_parity(
            workers, single, [make_batch(base_model, seed=1), one_sample_batch(base_model)], fresh=True
        )
        pids = workers.pids
        os.kill(pids[1], signal.SIGKILL)
        batch = pack_for_trainer(make_batch(base_model, seed=5), workers_config(workers), 2)
        with pytest.raises(TrainerWorkerError, match=rf"rank 1 \(pid {pids[1]}\) exited \(exit code -9\)"):
            workers.train_step(batch)
        assert not any(alive(pid) for pid in pids), "no worker is left behind"
        with pytest.raises(TrainerWorkerError, match="stopped: trainer worker rank 1"):
            workers.train_step(batch)
    finally:
        workers.close()


def test_more_workers_than_gpus_is_an_error_before_any_process_starts():
    gpus = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"trainer\.num_workers = {gpus + 1} .* {gpus} are visible"):
        _check_devices(SimpleNamespace(device="cuda", num_workers=gpus + 1))
    assert _check_devices(SimpleNamespace(device="cpu", num_workers=(os.cpu_count() or 1) + 1)) == "cpu"


@pytest.mark.slow
def test_a_worker_group_that_cannot_start_leaves_no_process(tmp_path):
    started = time.monotonic()
    before = set(_children())
    with pytest.raises(Exception, match=str(tmp_path / "missing")) as raised:
        TrainerWorkers(spec(tmp_path / "missing", num_workers=2))
    assert any("raised in trainer worker rank" in note for note in raised.value.__notes__)
    assert set(_children()) - before == set()
    assert time.monotonic() - started < 60


def _children() -> list[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split() if alive(int(child))]


@pytest.mark.slow
@pytest.mark.follows_mode  # the config takes $ROLLFLOW_INFERENCE_MODE
async def test_a_run_resumes_on_another_number_of_workers_exactly_once_per_prompt(tmp_path):
    from rollflow import Orchestrator

    from .helpers.runs import read_jsonl, small_config

    def config(steps: int, workers: int):
        return small_config(
            tmp_path, f"orchestrator.steps={steps}", "checkpoint.every=1", f"trainer.num_workers={workers}"
        )

    metrics = []
    # 2 -> 1, then 1 -> 2: each resume reads the other's checkpoint (sharded, then a single trainer's).
    for steps, workers, resume in ((2, 2, False), (3, 1, True), (4, 2, True)):
        async with Orchestrator(config(steps, workers), resume=resume) as orchestrator:
            assert orchestrator.trainer.world_size == workers
            assert orchestrator.state.policy_version == len(metrics)  # the resumed step
            metrics += await orchestrator.run()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        # The engines sample with the weights the trainer holds, resumed ones included (sync mode).
        assert m["logprob_mismatch"] < 1e-4 and m["num_samples"] == 16 and m["skipped_update"] == 0
    run_dir = config(4, 2).run_dir
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    prompts = [r["prompt_index"] for r in read_jsonl(run_dir / "rollouts.jsonl")]
    assert sorted(prompts) == list(range(4 * 4)), "each prompt trained exactly once"
