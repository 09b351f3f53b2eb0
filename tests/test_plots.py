"""``rollflow plot``: PNGs of real runs' metrics, runs compared on one figure, clear errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from rollflow import Orchestrator, load_config
from rollflow.cli import main
from rollflow.plots import FIGURES, read_metrics

from .helpers.images import read_png


async def train(config) -> None:
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real 3-step runs of the tiny model with different seeds (prompts and samples); the second with a
    behaviour correction from the ``[trainer.off_policy]`` table."""
    root = tmp_path_factory.mktemp("runs")
    runs = []
    for name, seed, extra in (("seed-0", 0, []), ("seed-1", 1, ["trainer.off_policy.kind='icepop'"])):
        config = load_config(
            [],
            [
                f"output_dir='{root}'",
                f"name={name}",
                "orchestrator.steps=3",
                "orchestrator.prompts_per_step=4",
                "sampling.samples_per_prompt=4",
                "sampling.max_tokens=4",
                f"seed={seed}",
                f"data.seed={seed}",
                "data.task='digit'",
                *extra,
            ],
        )
        asyncio.run(train(config))
        runs.append(config.run_dir)
    return runs


@pytest.mark.slow
def test_plot_compares_runs_in_pngs(two_runs, tmp_path):
    out = tmp_path / "plots"
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", "plot", *map(str, two_runs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        *("reward.png", "loss.png", "kl.png", "staleness.png", "throughput.png", "timings.png"),
        *("pipeline.png", "off_policy.png"),
    }
    # No [eval] section in these runs: no eval figure.
    assert set(line["files"]) == expected == {p.name for p in out.iterdir()}
    for name in expected:
        read_png(out / name)


@pytest.mark.slow
def test_the_drift_metrics_reach_every_steps_record(two_runs):
    plain, corrected = (read_metrics(run) for run in two_runs)
    for record in plain + corrected:
        assert (
            record["off_policy/kl_k3"] >= 0
            and record["off_policy/ratio_p1"] <= record["off_policy/ratio_p99"]
        )
    # Only the run with a masking rule reports what it masked; nothing truncates under icepop.
    assert all(0 <= record["off_policy/masked_token_fraction"] <= 1 for record in corrected)
    assert not any("off_policy/masked_token_fraction" in record for record in plain)
    assert not any("off_policy/truncated_token_fraction" in record for record in corrected)


@pytest.mark.slow
def test_single_run_default_out_and_eval_figure(two_runs, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = read_metrics(two_runs[0])
    # Evaluation metrics every other step (as `[eval] every = 2` logs them), and a torn last line.
    for record in records[::2]:
        record["eval/reward_mean"] = 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "rew')
    assert main(["plot", str(run)]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert "eval.png" in files and (run / "plots" / "eval.png").is_file()
    read_png(run / "plots" / "eval.png")
    assert len(files) <= len(FIGURES)


def test_bad_runs_are_clear_errors(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "no step recorded yet" in capsys.readouterr().err


def test_missing_matplotlib_names_the_install_command(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert main(["plot", str(tmp_path)]) == 2
    assert "pip install 'rollflow[plot]'" in capsys.readouterr().err
