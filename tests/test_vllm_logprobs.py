"""A real vLLM started by rollflow reports the logprobs the trainer recomputes, and the start-up check
rejects one started without ``--logprobs-mode processed_logprobs`` (GPU machines with vLLM only)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install 'rollflow[vllm]'"
    ),
]

TEMPERATURE = 0.7
# float32 on both sides, so the figure is the sampler's and the trainer's arithmetic, not bf16 rounding.
OPTIONS = {"max_model_len": 256, "gpu_memory_utilization": 0.3}


async def test_vllm_logprobs_equal_the_trainers_and_raw_mode_is_rejected(
    tmp_path: Path, tiny_model_dir: Path
):
    from rollflow.config import TrainerConfig
    from rollflow.errors import ConfigError
    from rollflow.inference.logprob_check import check_server_logprobs
    from rollflow.inference.remote import RemoteInferenceClient
    from rollflow.launch.server_group import ServerGroup
    from rollflow.messages import FinishReason, GenerateRequest, Sample, SamplingParams
    from rollflow.models.loading import load_causal_lm, resolve_model_path
    from rollflow.train.trainer import Trainer, build_micro_batch

    model = os.environ.get("ROLLFLOW_VLLM_TEST_MODEL", str(tiny_model_dir))
    options = {**OPTIONS, "extra_args": ["--dtype", "float32"]}
    async with ServerGroup(
        model, 1, tmp_path / "processed", engine="vllm", startup_timeout_s=600, server_options=options
    ) as group:
        await check_server_logprobs(group.urls, TEMPERATURE)
        client = RemoteInferenceClient(group.urls[0], group.urls, control_timeout_s=300)
        samples = []
        for index, params in enumerate(
            [
                SamplingParams(max_tokens=16, temperature=TEMPERATURE, seed=1),
                SamplingParams(max_tokens=16, temperature=TEMPERATURE, top_k=20, seed=2),
            ]
        ):
            output = await client.generate(GenerateRequest([1, 2, 3, 4, 5], params))
            samples.append(
                Sample(
                    prompt_index=0,
                    sample_index=index,
                    prompt_token_ids=[1, 2, 3, 4, 5],
                    completion_token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    policy_versions=output.policy_versions,
                    finish_reason=FinishReason.LENGTH,
                    kept_counts=output.kept_counts,
                )
            )
        await client.close()
    assert samples[1].kept_counts == [20] * len(samples[1].completion_token_ids)  # vLLM's top-k, filled in
    trainer = Trainer(
        load_causal_lm(resolve_model_path(model)),
        TrainerConfig(device="cuda", dtype="float32"),
        temperature=TEMPERATURE,
    )
    batch = build_micro_batch(samples, [1.0, 1.0], pad_token_id=0, device=trainer.device)
    with torch.no_grad():
        policy = trainer._token_logprobs(trainer.model, batch)
    diff = (policy.logprobs - batch.old_logprobs)[batch.loss_mask].abs()
    print(
        f"vLLM vs trainer logprobs at temperature {TEMPERATURE}: mean {diff.mean():.2e}, max {diff.max():.2e}"
    )
    assert float(diff.max()) < 1e-3

    raw = {**OPTIONS, "extra_args": ["--dtype", "float32", "--logprobs-mode", "raw_logprobs"]}
    async with ServerGroup(
        model, 1, tmp_path / "raw", engine="vllm", startup_timeout_s=600, server_options=raw
    ) as group:
        with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs"):
            await check_server_logprobs(group.urls, TEMPERATURE)
