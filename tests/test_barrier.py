"""The weight-update barrier: a hung transfer ends in a clear error within the timeout, engines resumed."""

from __future__ import annotations

import time

import anyio
import pytest

from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.engine.engine import TorchEngine
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.orchestrator.barrier import WeightBarrier, WeightSyncTimeoutError
from rollflow.weights import WeightTransfer, create_strategy


class HungTransfer:
    """Stands in for a peer that never joins the transfer (a dead trainer-side broadcast)."""

    closed = False

    async def push(self, client, named_weights, policy_version):
        await anyio.sleep_forever()

    def close(self):
        self.closed = True


@pytest.fixture
async def client(tiny_model_dir):
    engine = TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=4, max_model_len=64)
    client = LocalInferenceClient([engine])
    yield client
    await client.close()


async def test_hung_transfer_fails_within_the_timeout_and_resumes(client):
    barrier = WeightBarrier(client, HungTransfer(), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"weight_sync\.timeout_s = 0\.5"):
        await barrier.update(lambda: [], policy_version=1, pause_mode="wait")
    assert time.monotonic() - started < 2.0
    assert not await client.is_paused()
    output = await client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))
    assert len(output.token_ids) == 2  # the engine serves again
    barrier.close()
    assert barrier.transfer.closed


async def test_local_transfer_bumps_the_policy_version(client):
    engine = client.engines[0]
    weights = [(name, tensor.clone()) for name, tensor in engine.model.state_dict().items()]
    barrier = WeightBarrier(client, WeightTransfer(create_strategy("local")), timeout_s=30)
    timings = await barrier.update(lambda: weights, policy_version=7, pause_mode="wait")
    assert timings["barrier_time_s"] >= timings["transfer_time_s"] >= 0
    output = await client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    assert output.policy_versions == [7, 7]
    assert not await client.is_paused()
