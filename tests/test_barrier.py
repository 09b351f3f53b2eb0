"""The weight-update barrier: a hung transfer ends in a clear error within the timeout, engines resumed."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from rollflow.inference.client import LocalInferenceClient
from rollflow.inference.engine.engine import TorchEngine
from rollflow.messages import FinishReason, GenerateRequest, SamplingParams
from rollflow.orchestrator.barrier import PUSH_BACKSTOP_GRACE_S, WeightBarrier, WeightSyncTimeoutError
from rollflow.weights import StaticWeights, WeightTransfer, create_strategy

pytestmark = pytest.mark.local_only(reason="barriers that move weights into a private in-process engine")


class HungTransfer:
    """Stands in for a peer that never joins the transfer (a dead trainer-side broadcast)."""

    closed = False

    async def push(self, client, trainer, policy_version):
        await anyio.sleep_forever()

    def close(self):
        self.closed = True


@pytest.fixture
async def client(tiny_model_dir):
    engine = TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=4, max_model_len=64)
    client = LocalInferenceClient([engine])
    yield client
    await client.close()


@pytest.mark.slow
async def test_hung_transfer_fails_within_the_timeout_and_resumes(client):
    barrier = WeightBarrier(client, HungTransfer(), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"weight_sync\.timeout_s = 0\.5"):
        await barrier.update(StaticWeights(list), policy_version=1, pause_mode="wait")
    # A transfer that does not bound itself (it would hang for ever) is cut at the barrier's backstop, just
    # after the timeout; the bound is generous, for a loaded machine.
    assert time.monotonic() - started < 0.5 + PUSH_BACKSTOP_GRACE_S + 10
    assert not await client.is_paused()
    output = await client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))
    assert len(output.token_ids) == 2  # the engine serves again
    barrier.close()
    assert barrier.transfer.closed


async def test_local_transfer_bumps_the_policy_version(client):
    engine = client.engines[0]
    weights = [(name, tensor.clone()) for name, tensor in engine.model.state_dict().items()]
    barrier = WeightBarrier(client, WeightTransfer(create_strategy("local")), timeout_s=30)
    timings = await barrier.update(StaticWeights(lambda: weights), policy_version=7, pause_mode="wait")
    assert timings["barrier_time_s"] >= timings["transfer_time_s"] >= 0
    output = await client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    assert output.policy_versions == [7, 7]
    assert not await client.is_paused()


def _perturbed_weights(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's weights, moved far enough that greedy decoding takes another path."""
    from rollflow.models.loading import load_causal_lm

    model = load_causal_lm(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]


async def _server_running(url: str) -> int:
    """``vllm:num_requests_running`` from a server's ``/metrics``."""
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    return int(float(line.split()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "where",
    [
        "in_process",
        pytest.param("http", marks=pytest.mark.http_only(reason="the same barrier on a private server")),
    ],
)
async def test_keep_barrier_continues_frozen_requests_on_the_new_weights(where, tiny_model_dir, tmp_path):
    """A request frozen by a ``keep`` barrier resumes on the new weights: its tokens up to the barrier are
    the old policy's (equal to an undisturbed run), the rest are stamped with the new version, and the
    per-token versions say exactly where it switched."""
    from contextlib import AsyncExitStack

    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.launch.server_group import ServerGroup

    # The tiny model only stops on stop tokens, so every request runs its full budget (~0.3 ms per token).
    request = GenerateRequest([5, 17, 42, 99, 3], SamplingParams(max_tokens=1500, temperature=0.0))
    async with AsyncExitStack() as stack:
        if where == "in_process":
            engine = TorchEngine.from_pretrained(str(tiny_model_dir), max_batch_size=4, max_model_len=2048)
            client = LocalInferenceClient([engine])
            stack.push_async_callback(client.close)
            transfer = WeightTransfer(create_strategy("local"))

            async def running() -> int:
                return engine.num_running
        else:
            servers = await stack.enter_async_context(
                ServerGroup("rollflow:tiny", 1, tmp_path / "logs", startup_timeout_s=120)
            )
            client = RemoteInferenceClient(servers.urls[0], servers.urls, control_timeout_s=60)
            stack.push_async_callback(client.close)
            transfer = WeightTransfer(create_strategy("broadcast", backend="gloo", timeout_s=60))

            async def running() -> int:
                return await _server_running(servers.urls[0])

        stack.callback(transfer.close)
        undisturbed = await client.generate(request)
        assert set(undisturbed.policy_versions) == {0}

        barrier = WeightBarrier(client, transfer, timeout_s=60)
        weights = _perturbed_weights(tiny_model_dir, seed=1)
        async with anyio.create_task_group() as tg:
            outputs = []

            async def generate() -> None:
                outputs.append(await client.generate(request))

            tg.start_soon(generate)
            with anyio.fail_after(30):
                while not await running():
                    await anyio.sleep(0.002)
            await barrier.update(StaticWeights(lambda: weights), policy_version=1, pause_mode="keep")

    (output,) = outputs
    versions = output.policy_versions
    switch = versions.index(1) if 1 in versions else len(versions)
    assert 0 < switch < len(versions), f"the barrier did not land mid-request (switch at {switch})"
    assert versions == [0] * switch + [1] * (len(versions) - switch)
    assert output.token_ids[:switch] == undisturbed.token_ids[:switch]
    assert output.token_ids != undisturbed.token_ids  # the new weights took over
    assert output.finish_reason is FinishReason.LENGTH and len(output.token_ids) == 1500


async def test_each_phase_is_bounded_and_named(client, monkeypatch):
    """A pause that never returns fails as the pause phase, within the timeout, and the engines are resumed;
    the push is never attempted."""
    pushed = []

    class RecordingTransfer(HungTransfer):
        async def push(self, client, trainer, policy_version):
            pushed.append(policy_version)

    async def hung_pause(mode):
        await anyio.sleep_forever()

    monkeypatch.setattr(client.control, "pause", hung_pause)
    barrier = WeightBarrier(client, RecordingTransfer(), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(
        WeightSyncTimeoutError, match="pausing the engines took longer than weight_sync.timeout_s"
    ):
        await barrier.update(StaticWeights(list), policy_version=1, pause_mode="wait")
    assert time.monotonic() - started < 0.5 + 10  # the pause hangs for ever; generous, for a loaded machine
    assert pushed == []
    assert not await client.is_paused()
