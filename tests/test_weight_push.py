"""Weights pushed from the trainer (in a thread, or in a process of its own) into real ``rollflow serve`` servers
through the weight barrier: outputs, versions, and every failure ending in a named error within the timeout."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rollflow.config import TrainerConfig
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.weights import WeightTransfer, WeightTransferError, create_strategy

from .helpers.processes import wait_dead
from .helpers.training import make_batch
from .helpers.weights import GREEDY, PROMPTS, server_outputs

pytestmark = pytest.mark.http_only(reason="trainers pushing weights into private servers (broadcast)")

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two ``rollflow serve`` servers of this module's own (pushes change their weights)."""
    from .helpers.servers import BackgroundServerGroup

    group = BackgroundServerGroup(2, tmp_path_factory.mktemp("push-servers"))
    yield group
    group.close()


class Trainers:
    """One trainer per placement, built on first use and shared by this module's tests (a trainer process or
    worker group takes seconds to start): in a thread, in a process, and 2 data-parallel workers (fsdp2, ddp)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.built: dict[str, Any] = {}

    def __getitem__(self, placement: str) -> Any:
        if placement not in self.built:
            self.built[placement] = build_trainer(placement, self.model_dir)
        return self.built[placement]

    def close(self) -> None:
        for trainer in self.built.values():
            if hasattr(trainer, "close"):
                trainer.close()


@pytest.fixture(scope="module")
def trainers(tiny_model_dir):
    built = Trainers(tiny_model_dir)
    yield built
    built.close()


def build_trainer(placement: str, model_dir) -> Any:
    from rollflow.models.loading import load_causal_lm
    from rollflow.train.process import TrainerProcess, TrainerSpec
    from rollflow.train.trainer import Trainer
    from rollflow.train.workers import TrainerWorkers

    # A large learning rate: one step moves the tiny model far enough that greedy decoding changes.
    config = TrainerConfig(lr=0.01)
    if placement == "thread":
        return Trainer(load_causal_lm(model_dir), config, pad_token_id=0)
    if placement in ("fsdp2", "ddp"):
        config = TrainerConfig(lr=0.01, num_workers=2, parallelism=placement)
    spec = TrainerSpec(
        model_dir=model_dir, config=config, temperature=1.0, pad_token_id=0, seed=0, off_policy="none"
    )
    return TrainerProcess(spec) if placement == "process" else TrainerWorkers(spec)


@torch.no_grad()
def argmax_continuations(model_dir, named_weights) -> list[list[int]]:
    """Greedy continuations of ``PROMPTS`` by plain argmax over a Hugging Face forward of the trainer's weights."""
    from rollflow.models.loading import load_causal_lm

    model = load_causal_lm(model_dir)
    model.load_state_dict({name: tensor.clone() for name, tensor in named_weights}, strict=False)
    outputs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        outputs.append(ids[len(prompt) :])
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["thread", "process", "fsdp2", "ddp"])
async def test_pushes_from_the_trainer_reach_both_servers(
    placement, servers, trainers, tiny_model_dir, tmp_path
):
    """After each push (broadcast over gloo, checkpoint over HTTP, checkpoint through a directory) both
    servers decode greedily exactly as the trainer's model does by argmax (of the gathered full weights, for
    2 workers), and report the pushed version. With 2 workers, every rank iterates every weight of a push
    (joining each gather) and only rank 0 holds a session (store, group, files) and answers."""
    import anyio

    trainer = trainers[placement]
    records = tmp_path / "ranks"
    if placement in ("fsdp2", "ddp"):
        records.mkdir()
        trainer = RecordingRanks(trainer, records)
    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    strategies = [
        create_strategy("broadcast", backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S),
        create_strategy("checkpoint", timeout_s=TIMEOUT_S),
        create_strategy("checkpoint", checkpoint_dir=tmp_path / "ckpt", timeout_s=TIMEOUT_S),
    ]
    try:
        base = (await client.weight_info())[servers.urls[0]]["weight_version"]
        for offset, strategy in enumerate(strategies, start=1):
            version = int(base) + offset
            before, _ = await server_outputs(servers.urls[0])
            seed = offset + 10 * ["thread", "process", "fsdp2", "ddp"].index(placement)
            batch = pack_for_trainer(
                make_batch(_reference_model(tiny_model_dir), seed=seed), TrainerConfig(), trainer.world_size
            )
            assert (await anyio.to_thread.run_sync(trainer.train_step, batch)).updated
            barrier = WeightBarrier(client, WeightTransfer(strategy), timeout_s=TIMEOUT_S)
            try:
                # Twice: the first connects, the second reuses the connection.
                await barrier.update(trainer, version, "keep")
                await barrier.update(trainer, version, "keep")
            finally:
                barrier.close()
            expected = argmax_continuations(tiny_model_dir, trainer.named_weights())
            assert expected != before  # the trained weights change what greedy decoding says
            for url in servers.urls:
                outputs, versions = await server_outputs(url)
                assert outputs == expected, (strategy.name, url)
                assert versions == {version}
            answers = await client.weight_info()
            assert [body["weight_version"] for body in answers.values()] == [str(version)] * 2
            if records.is_dir():
                check_only_rank_0_sends(records, num_weights=len(expected_names(tiny_model_dir)))
    finally:
        await client.close()


def expected_names(model_dir) -> list[str]:
    return [name for name, _ in _reference_model(model_dir).state_dict().items()]


@dataclass(frozen=True)
class RecordsRank:
    """Wraps a transport call (picklable, it runs in each worker): counts the weights the call iterated on
    this rank, and notes which of this process's transfer sessions exist after it, in ``records/rank<r>``."""

    call: Any
    records: str

    def __call__(self, rank: int, named_weights: Any) -> Any:
        import json

        from rollflow.weights.trainer import sessions as transport

        iterated = []

        def counting() -> Any:
            for name, tensor in named_weights:
                iterated.append(name)
                yield name, tensor

        result = self.call(rank, counting())
        with transport._lock:
            sessions = sorted(r for (tid, r) in transport._sessions if tid == self.call.transport.transfer_id)
        record = {"op": self.call.op, "pid": os.getpid(), "iterated": len(iterated), "sessions": sessions}
        record["answered"] = result is not None
        with open(os.path.join(self.records, f"rank{rank}"), "a") as file:
            file.write(json.dumps(record) + "\n")
        return result


class RecordingRanks:
    """A worker-group handle whose pushes record what each rank did (see ``RecordsRank``)."""

    def __init__(self, trainer: Any, records):
        self.trainer = trainer
        self.records = records
        self.world_size = trainer.world_size

    def train_step(self, *args: Any) -> Any:
        return self.trainer.train_step(*args)

    def named_weights(self) -> Any:
        return self.trainer.named_weights()

    def push_weights(self, call: Any) -> Any:
        return self.trainer.push_weights(RecordsRank(call, str(self.records)))


def check_only_rank_0_sends(records, num_weights: int) -> None:
    """Read (and clear) the records: ranks in other processes; every push iterated by every rank; only rank
    0 holds a session or answers."""
    import json

    ranks = {}
    for path in sorted(records.iterdir()):
        ranks[int(path.name.removeprefix("rank"))] = [
            json.loads(line) for line in path.read_text().splitlines()
        ]
        path.unlink()
    assert sorted(ranks) == [0, 1]
    assert {r["pid"] for r in ranks[0]}.isdisjoint({r["pid"] for r in ranks[1]})
    for rank, calls in ranks.items():
        pushes = [r for r in calls if r["op"] == "push"]
        assert len(pushes) == 2, calls  # two updates per strategy
        assert all(r["iterated"] == num_weights for r in pushes), (rank, pushes)
        if rank == 0:
            assert all(r["sessions"] == [0] for r in calls if r["op"] != "close"), calls
        else:
            assert all(r["sessions"] == [] and not r["answered"] for r in calls), calls
    assert any(r["answered"] for r in ranks[0])


_REFERENCE: dict[str, Any] = {}


def _reference_model(model_dir) -> Any:
    """The untrained model, for building batches (its logprobs make the behaviour policy)."""
    if "model" not in _REFERENCE:
        from rollflow.models.loading import load_causal_lm

        _REFERENCE["model"] = load_causal_lm(model_dir)
    return _REFERENCE["model"]


@dataclass(frozen=True)
class FailingPush:
    """Wraps a transport call (picklable, so it runs in a trainer process too): the weights raise after two
    tensors, as a gather that fails mid-push would; on ``rank`` only, if given."""

    call: Any
    rank: int | None = None

    def __call__(self, rank: int, named_weights: Any) -> Any:
        if self.call.op != "push" or self.rank not in (None, rank):
            return self.call(rank, named_weights)

        def failing() -> Any:
            for index, item in enumerate(named_weights):
                if index == 2:
                    raise RuntimeError("gathering layer 2 failed")
                yield item

        return self.call(rank, failing())


class FailOnce:
    """A trainer handle whose next push fails in the trainer (see ``FailingPush``)."""

    def __init__(self, trainer: Any, rank: int | None = None):
        self.trainer = trainer
        self.rank = rank
        self.fail = True

    def named_weights(self) -> Any:
        return self.trainer.named_weights()

    def push_weights(self, call: Any) -> Any:
        if self.fail and call.op == "push":
            self.fail = False
            return self.trainer.push_weights(FailingPush(call, self.rank))
        return self.trainer.push_weights(call)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["thread", "process"])
async def test_a_trainer_side_failure_names_the_rank_and_the_servers_recover(placement, servers, trainers):
    trainer = trainers[placement]
    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S))
    barrier = WeightBarrier(client, transfer, timeout_s=TIMEOUT_S)
    failing = FailOnce(trainer)
    try:
        base = int((await client.weight_info())[servers.urls[0]]["weight_version"])
        await barrier.update(trainer, base + 1, "keep")  # connected
        started = time.perf_counter()
        with pytest.raises(WeightTransferError, match=r"trainer rank 0: .*gathering layer 2 failed"):
            await transfer.push(client.control, failing, base + 2)  # no retry here, unlike the barrier
        assert time.perf_counter() - started < TIMEOUT_S
        assert not failing.fail
        # The servers were left mid-update; the next push reconnects and lands the version everywhere.
        await barrier.update(trainer, base + 2, "keep")
        for url in servers.urls:
            _, versions = await server_outputs(url)
            assert versions == {base + 2}
        # Through the barrier, a failed push is retried once on a new connection.
        failing.fail = True
        await barrier.update(failing, base + 3, "keep")
        assert not failing.fail
        for url in servers.urls:
            _, versions = await server_outputs(url)
            assert versions == {base + 3}
    finally:
        barrier.close()
        await client.close()


@pytest.mark.slow
@pytest.mark.parametrize(("placement", "failing_rank"), [("fsdp2", 1), ("fsdp2", 0), ("ddp", 1)])
async def test_a_failure_on_one_worker_mid_push_names_its_rank_within_the_timeout(
    placement, failing_rank, servers, trainers, tiny_model_dir
):
    """One rank raises mid-push: under fsdp2 the other is then stuck in a gather it never joins (rank 0
    mid-broadcast, or rank 1 waiting for rank 0), so the group is stopped; under ddp the other rank finishes.
    Either way the push ends within the timeout with an error naming the failed rank, and the servers take
    the next push. Runs after the push test (it may end the shared group)."""
    from rollflow.weights import StaticWeights

    trainer = trainers[placement]
    if getattr(trainer, "_failure", None) is not None:  # stopped by the previous case: a fresh group
        trainer = trainers.built[placement] = build_trainer(placement, tiny_model_dir)
    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S))
    barrier = WeightBarrier(client, transfer, timeout_s=TIMEOUT_S)
    failing = FailOnce(trainer, rank=failing_rank)
    try:
        base = int((await client.weight_info())[servers.urls[0]]["weight_version"])
        await barrier.update(trainer, base + 1, "keep")  # connected
        started = time.perf_counter()
        with pytest.raises(
            WeightTransferError, match=rf"trainer rank {failing_rank}: .*gathering layer 2 failed"
        ) as raised:
            await transfer.push(client.control, failing, base + 2)
        assert time.perf_counter() - started < TIMEOUT_S
        assert any(f"raised in trainer worker rank {failing_rank}" in note for note in raised.value.__notes__)
        assert not failing.fail
        if placement == "fsdp2":  # the other rank was stuck in a collective: the group is stopped
            with pytest.raises(Exception, match=f"stopped: rank {failing_rank} raised"):
                trainer.push_weights(count_weights)
            survivor = StaticWeights(lambda: list(_reference_model(tiny_model_dir).state_dict().items()))
        else:
            survivor = trainer
        await barrier.update(survivor, base + 2, "keep")
        for url in servers.urls:
            _, versions = await server_outputs(url)
            assert versions == {base + 2}
    finally:
        barrier.close()
        await client.close()


def count_weights(rank: int, named_weights: Any) -> int:
    return sum(1 for _ in named_weights)


@pytest.mark.slow
async def test_a_server_that_dies_mid_push_is_named_and_the_rest_get_the_weights(tiny_model_dir, tmp_path):
    """A server killed while the trainer pushes: without dropping, the barrier fails at once naming it (no
    retry against the same servers, which would block on the dead one); a client that drops unreachable
    servers (as runs use) carries on with the survivor."""
    from rollflow.launch.server_group import ServerGroup
    from rollflow.models.loading import load_causal_lm
    from rollflow.weights import StaticWeights

    weights = list(load_causal_lm(tiny_model_dir).state_dict().items())

    class KillsServerOnPush(StaticWeights):
        def __init__(self, pid: int):
            super().__init__(lambda: weights)
            self.pid: int | None = pid

        def push_weights(self, call: Any) -> Any:
            if call.op == "push" and self.pid is not None:
                os.kill(self.pid, signal.SIGKILL)
                assert wait_dead([self.pid], timeout_s=60) == [], f"server {self.pid} did not die"
                self.pid = None
            return super().push_weights(call)

    async with ServerGroup("rollflow:tiny", 2, tmp_path / "logs", startup_timeout_s=120) as group:
        victim_url = group.urls[1]
        strict = RemoteInferenceClient(group.urls[0], group.urls, control_timeout_s=60)
        barrier = WeightBarrier(
            strict,
            WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S)),
            timeout_s=TIMEOUT_S,
        )
        trainer = KillsServerOnPush(group.pids[1])
        try:
            started = time.perf_counter()
            with pytest.raises(Exception, match=victim_url) as raised:
                await barrier.update(trainer, 1, "wait")
            assert time.perf_counter() - started < TIMEOUT_S
            assert trainer.pid is None  # it died mid-push, not before
            assert "update_weights" in str(raised.value) or "get_world_size" in str(raised.value)
        finally:
            barrier.close()
            await strict.close()

        dropping = RemoteInferenceClient(
            group.urls[0], group.urls, control_timeout_s=60, drop_unreachable_servers=True
        )
        barrier = WeightBarrier(
            dropping,
            WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S)),
            timeout_s=TIMEOUT_S,
        )
        try:
            await barrier.update(StaticWeights(lambda: weights), 2, "wait")
            assert dropping.server_urls == [group.urls[0]]
            _, versions = await server_outputs(group.urls[0])
            assert versions == {2}
        finally:
            barrier.close()
            await dropping.close()


@dataclass(frozen=True)
class DiesMidPush:
    """Runs in the trainer process: it kills that process after two tensors of the push."""

    call: Any

    def __call__(self, rank: int, named_weights: Any) -> Any:
        if self.call.op != "push":
            return self.call(rank, named_weights)

        def dying() -> Any:
            for index, item in enumerate(named_weights):
                if index == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item

        return self.call(rank, dying())


@pytest.mark.slow
async def test_a_trainer_process_that_dies_mid_push_fails_the_barrier_and_the_servers_serve_on(
    servers, tiny_model_dir
):
    from rollflow.train.process import TrainerProcessError
    from rollflow.weights import StaticWeights

    trainer = build_trainer("process", tiny_model_dir)

    class Dying:
        def push_weights(self, call: Any) -> Any:
            return trainer.push_weights(DiesMidPush(call))

    client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
    barrier = WeightBarrier(
        client,
        WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=TIMEOUT_S)),
        timeout_s=TIMEOUT_S,
    )
    try:
        base = int((await client.weight_info())[servers.urls[0]]["weight_version"])
        started = time.perf_counter()
        with pytest.raises(TrainerProcessError, match=r"exited \(exit code -9\) during push_weights"):
            await barrier.update(Dying(), base + 1, "keep")
        assert time.perf_counter() - started < TIMEOUT_S
        assert not await client.is_paused()
        # The servers were left mid-update by a dead peer; another trainer's push lands.
        weights = [(n, t.clone()) for n, t in _reference_model(tiny_model_dir).state_dict().items()]
        await barrier.update(StaticWeights(lambda: weights), base + 2, "keep")
        for url in servers.urls:
            _, versions = await server_outputs(url)
            assert versions == {base + 2}
    finally:
        barrier.close()
        await client.close()
        trainer.close()


@pytest.mark.slow
async def test_a_run_with_a_trainer_process_pushes_from_the_child(tmp_path, monkeypatch):
    """http mode, 2 servers, ``trainer.placement = "process"``: every barrier is pushed by the child (the
    orchestrator never maps its weights) and the servers hold the last version."""
    from rollflow import Orchestrator

    from .helpers.runs import small_config

    monkeypatch.delenv("ROLLFLOW_INFERENCE_MODE", raising=False)
    config = small_config(
        tmp_path, "inference.mode='http'", "trainer.placement='process'", "orchestrator.steps=2"
    )
    async with Orchestrator(config) as orchestrator:
        metrics = await orchestrator.run()
        assert orchestrator.trainer._weights is None  # no shared-memory mapping in this process
        answers = await orchestrator.client.weight_info()
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["weight_transfer_time_s"] > 0 for m in metrics)
    assert [body["weight_version"] for body in answers.values()] == ["2", "2"]
