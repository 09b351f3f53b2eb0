"""``rollflow generate --checkpoint``: sampling from a trained policy, and clear errors for bad paths."""

from __future__ import annotations

import json

import pytest

from .conftest import REPO_ROOT

QUICKSTART = REPO_ROOT / "examples" / "quickstart.toml"


def _sets(tmp_path, *extra: str) -> list[str]:
    sets = [f"output_dir='{tmp_path}'", "orchestrator.prompts_per_step=4", "sampling.samples_per_prompt=2"]
    return [arg for value in (*sets, *extra) for arg in ("--set", value)]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step quickstart run with a checkpoint after each step."""
    from rollflow.cli import main

    output_dir = tmp_path_factory.mktemp("trained")
    sets = _sets(output_dir, "orchestrator.steps=2", "checkpoint.every=1")
    assert main(["run", str(QUICKSTART), "--no-progress", *sets]) == 0
    return output_dir / "quickstart"


def _generate(tmp_path, checkpoint: str, output) -> int:
    from rollflow.cli import main

    sets = _sets(tmp_path, "name='sampling'")
    args = ["generate", str(QUICKSTART), *sets, "--num-prompts", "2", "--output", str(output)]
    return main([*args, "--checkpoint", checkpoint])


@pytest.mark.parametrize(("where", "version"), [("run_dir", 2), ("step_000001", 1)])
def test_generate_samples_from_the_checkpoint_weights(trained_run, tmp_path, where, version):
    """A run directory means its latest checkpoint; a checkpoint directory means itself. Every token is
    stamped with the checkpoint's policy version, which the engines only hold after its weights arrived."""
    checkpoint = trained_run if where == "run_dir" else trained_run / "checkpoints" / where
    output = tmp_path / "samples.jsonl"
    assert _generate(tmp_path, str(checkpoint), output) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 4
    assert {v for line in lines for v in line["policy_versions"]} == {version}


def test_generate_from_the_weights_the_trainer_saved(trained_run, tiny_model_dir):
    """The engine that ``--checkpoint`` feeds holds exactly the checkpoint's tensors (not the initial ones)."""
    import torch

    from rollflow.models.loading import load_causal_lm
    from rollflow.orchestrator.checkpoint import load_policy_weights, resolve_checkpoint

    weights, version = load_policy_weights(resolve_checkpoint(trained_run))
    initial = load_causal_lm(tiny_model_dir).state_dict()
    assert version == 2
    assert set(weights) <= set(initial)
    assert any(not torch.equal(weights[name], initial[name]) for name in weights)  # training moved them


def test_bad_checkpoint_paths_fail_clearly_before_any_engine_starts(trained_run, tmp_path, capsys):
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(empty_run): "neither a checkpoint",
        str(broken): "no readable model.safetensors",
    }
    for path, message in cases.items():
        output = tmp_path / "out.jsonl"
        assert _generate(tmp_path, path, output) == 1, path
        assert message in capsys.readouterr().err, path
        assert not output.exists() or not output.read_text()
