"""Weights that are finite as sent but overflow on the cast into the serving dtype are refused (issue 30, item
7): a float64 1e300 is inf in float32. Before, it passed the finiteness check, was loaded ("Weights updated"),
and every later request failed with "non-finite logits".
"""

from __future__ import annotations

import copy

import aiohttp
import pytest
import torch
from safetensors.torch import save_file

from rollflow.errors import EngineError
from rollflow.inference.engine import TorchEngine
from rollflow.inference.engine.server import EngineServer
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.models.loading import load_causal_lm, load_tokenizer

NAME = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def overflowing(model) -> torch.Tensor:
    """The model's own embedding in float64, with one entry beyond float32's range."""
    tensor = model.state_dict()[NAME].to(torch.float64).clone()
    tensor[3, 5] = 1e300
    return tensor


async def test_the_engine_refuses_a_tensor_that_overflows_in_its_dtype(model):
    engine = TorchEngine(copy.deepcopy(model), max_batch_size=2, max_model_len=64)
    before = engine.model.state_dict()[NAME].clone()
    request = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    try:
        expected = await engine.generate(request)
        with pytest.raises(EngineError) as caught:
            await engine.load_weights([(NAME, overflowing(model))], policy_version=1)
        message = str(caught.value)
        assert NAME in message and "float64 -> float32" in message and "1e+300" in message
        assert "overflow to inf" in message and "the weights were not changed" in message
        assert torch.equal(engine.model.state_dict()[NAME], before) and engine.policy_version == 0
        # Still serving, with the old weights.
        output = await engine.generate(request)
        assert output.token_ids == expected.token_ids
        # A float64 tensor within range is cast and loaded.
        in_range = before.to(torch.float64) * 0.5
        await engine.load_weights([(NAME, in_range)], policy_version=2)
        assert torch.equal(engine.model.state_dict()[NAME], in_range.to(torch.float32))
        assert engine.policy_version == 2
    finally:
        await engine.shutdown()


def test_every_narrower_serving_dtype_is_checked_after_the_cast():
    state = {"w": torch.zeros(2, dtype=torch.float16), "v": torch.zeros(2, dtype=torch.bfloat16)}
    with pytest.raises(EngineError, match=r"w \(float32 -> float16, largest magnitude 1e\+05 > 6.55e\+04\)"):
        TorchEngine._cast_finite([("w", torch.tensor([1.0, 1e5]))], state)
    with pytest.raises(EngineError, match=r"w \(int64 -> float16"):
        TorchEngine._cast_finite([("w", torch.tensor([1, 100_000]))], state)
    with pytest.raises(EngineError, match=r"v \(float64 -> bfloat16"):
        TorchEngine._cast_finite([("v", torch.tensor([1.0, 1e39], dtype=torch.float64))], state)
    cast = TorchEngine._cast_finite([("w", torch.tensor([1.0, 60000.0])), ("v", torch.tensor([3e38]))], state)
    assert [tensor.dtype for _, tensor in cast] == [torch.float16, torch.bfloat16]


async def test_the_server_answers_400_and_keeps_serving_after_an_overflowing_update(
    model, tiny_model_dir, tmp_path
):
    engine = TorchEngine(copy.deepcopy(model), max_batch_size=2, max_model_len=64)
    server = EngineServer(engine, load_tokenizer(tiny_model_dir), served_model_name="tiny")
    await server.start()
    path = tmp_path / "policy.safetensors"
    save_file({NAME: overflowing(model)}, str(path))
    completion = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
    try:
        async with aiohttp.ClientSession() as http:
            for route, body in (
                ("init_weight_transfer_engine", {"init_info": {"backend": "checkpoint"}}),
                ("start_weight_update", {}),
            ):
                async with http.post(f"{server.url}/{route}", json=body) as response:
                    assert response.status == 200, await response.text()
            update = {"update_info": {"path": str(path), "policy_version": 1}}
            async with http.post(f"{server.url}/update_weights", json=update) as response:
                answer = await response.json()
                assert response.status == 400, answer
            assert NAME in answer["error"]["message"] and "overflow" in answer["error"]["message"]
            assert answer["error"]["param"] == "update_info"
            async with http.get(f"{server.url}/weight_info") as response:
                assert (await response.json())["policy_version"] == 0
            async with http.post(f"{server.url}/v1/completions", json=completion) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["choices"][0]["finish_reason"] == "length"
    finally:
        await server.close()
