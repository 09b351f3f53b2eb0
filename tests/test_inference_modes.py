"""The ``inference_client`` fixture's own promises, in whichever mode the suite runs: its engines are the
tiny model's, and a test that leaves the shared engines paused is caught (and they are resumed)."""

from __future__ import annotations

from rollflow.inference.client import InferenceClient
from rollflow.messages import GenerateRequest, SamplingParams

from .helpers.clients import suite_inference_mode


async def test_the_client_is_of_the_suites_mode_and_samples(inference_client, inference_backend):
    from rollflow.inference.client import LocalInferenceClient

    assert inference_backend.mode == suite_inference_mode()
    assert isinstance(inference_client, InferenceClient)
    assert isinstance(inference_client, LocalInferenceClient) == (inference_backend.mode == "local")
    output = await inference_client.generate(GenerateRequest([5, 6, 7], SamplingParams(max_tokens=3, seed=1)))
    assert len(output.token_ids) == len(output.logprobs) == 3 and output.policy_versions == [0, 0, 0]


async def test_leaving_the_shared_engines_paused_is_caught_and_undone(inference_client, inference_backend):
    assert await inference_backend.check_untouched() is None
    await inference_client.pause("abort")
    assert await inference_client.is_paused()
    assert "paused" in await inference_backend.check_untouched()
    assert not await inference_client.is_paused()
    assert await inference_backend.check_untouched() is None
