"""Weights pushed from a trainer on a CUDA GPU into a real ``rollflow serve --device cuda`` server
(``nox -s gpu_tests``): single-rank NCCL broadcast (into a server on a second GPU: NCCL allows one rank
per GPU), and CUDA IPC into a torch engine colocated on the trainer's GPU. After each
push the server decodes greedily exactly as the trainer's weights do by argmax, and reports the version."""

from __future__ import annotations

import os

import pytest
import torch

from rollflow.config import TrainerConfig
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.orchestrator.barrier import WeightBarrier
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.weights import WeightTransfer, create_strategy

from .helpers.training import make_batch
from .helpers.weights import GREEDY, PROMPTS, server_outputs

pytestmark = [
    pytest.mark.http_only(reason="a CUDA trainer pushing into a server"),
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TIMEOUT_S = 60.0


def second_gpu() -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's second visible GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1].strip() if visible else "1"


@pytest.fixture(scope="module")
def cuda_servers(tmp_path_factory):
    """``rollflow serve --device cuda`` engines, one per GPU placement, started on first use: ``same`` shares
    the trainer's GPU (colocated), ``other`` has the second GPU to itself."""
    from .helpers.servers import BackgroundServerGroup

    started: dict[str, BackgroundServerGroup] = {}

    def server(placement: str) -> BackgroundServerGroup:
        if placement not in started:
            env = {"CUDA_VISIBLE_DEVICES": second_gpu()} if placement == "other" else None
            started[placement] = BackgroundServerGroup(
                1,
                tmp_path_factory.mktemp(f"cuda-push-{placement}"),
                server_options={"device": "cuda"},
                env=env,
            )
        return started[placement]

    yield server
    for group in started.values():
        group.close()


@pytest.fixture(scope="module")
def cuda_trainer(tiny_model_dir):
    from rollflow.models.loading import load_causal_lm
    from rollflow.train.trainer import Trainer

    # float32, so the engine (float32 on the GPU too) and the reference argmax see the same weights; a large
    # learning rate, so one step changes what greedy decoding says.
    config = TrainerConfig(lr=0.01, device="cuda", dtype="float32")
    return Trainer(load_causal_lm(tiny_model_dir), config, pad_token_id=0)


@torch.no_grad()
def cuda_argmax_continuations(model_dir, named_weights) -> list[list[int]]:
    """Greedy continuations of ``PROMPTS`` by argmax over a Hugging Face forward of ``named_weights`` on the
    GPU (the device the server decodes on, so float rounding is alike)."""
    from rollflow.models.loading import load_causal_lm

    model = load_causal_lm(model_dir, device="cuda")
    model.load_state_dict(
        {name: tensor.to("cuda", copy=True) for name, tensor in named_weights}, strict=False
    )
    outputs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        outputs.append(ids[len(prompt) :])
    return outputs


@pytest.mark.parametrize(
    ("strategy", "options", "placement"),
    [
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): the server takes the second GPU.
        ("broadcast", {"backend": "nccl", "bucket_size_mb": 0.25}, "other"),
        ("cuda_ipc", {"bucket_size_mb": 0.25}, "same"),
    ],
)
async def test_a_cuda_trainer_pushes_into_a_torch_engine_server(
    strategy, options, placement, cuda_servers, cuda_trainer, tiny_model_dir
):
    """Single-rank NCCL broadcast into a server on another GPU; CUDA IPC into a server colocated on the
    trainer's GPU. Each push twice (connect, then reuse), then greedy decoding is compared."""
    from rollflow.models.loading import load_causal_lm

    if placement == "other" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the server on a second GPU (one rank per GPU); this machine has one")
    assert next(iter(cuda_trainer.named_weights()))[1].is_cuda, "the trainer's weights are on the GPU"
    url = cuda_servers(placement).urls[0]
    client = RemoteInferenceClient(url, [url], control_timeout_s=60)
    barrier = WeightBarrier(
        client, WeightTransfer(create_strategy(strategy, timeout_s=TIMEOUT_S, **options)), timeout_s=TIMEOUT_S
    )
    try:
        version = int((await client.weight_info())[url]["weight_version"]) + 1
        before, _ = await server_outputs(url)
        seed = 1 if strategy == "broadcast" else 2
        batch = pack_for_trainer(make_batch(load_causal_lm(tiny_model_dir), seed=seed), TrainerConfig())
        assert cuda_trainer.train_step(batch).updated
        # Twice: the first connects (NCCL group, or the IPC receiver), the second reuses it.
        await barrier.update(cuda_trainer, version, "keep")
        await barrier.update(cuda_trainer, version, "keep")
        expected = cuda_argmax_continuations(tiny_model_dir, cuda_trainer.named_weights())
        assert expected != before, "the trained weights change what greedy decoding says"
        outputs, versions = await server_outputs(url)
        assert outputs == expected
        assert versions == {version}
        assert (await client.weight_info())[url]["weight_version"] == str(version)
    finally:
        barrier.close()
        await client.close()
