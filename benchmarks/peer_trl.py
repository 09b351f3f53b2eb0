"""A peer race: rollflow against TRL's ``GRPOTrainer`` (no vLLM) on the same model, data, reward and settings.

The setup (issue 31): a random-init tiny Qwen3 (the embedded ``rollflow:tiny``'s files: 2 layers, width 64, a
1.6k vocabulary, its tokenizer and chat template) loaded from a plain directory, so each side renders with the
tokenizer's chat template; the first 400 prompts of the built-in ``case`` task as a JSONL file (``prompt``: the
messages, ``answer``: ``upper``/``lower``); the same reward (the fraction of letters in the asked case); 16
prompts x 8 samples per step, 8 new tokens, temperature 1, AdamW at a constant 1e-3, token-mean loss (rollflow's
``token_mean``, TRL's default ``dapo``), no KL, ``--steps`` steps. rollflow runs ``rollflow run`` with the
in-process engine; TRL runs ``GRPOTrainer.train`` on the CPU. Each run is a fresh process, as a user starts it.

Both sides alternate in this one invocation (seed by seed, the side that goes first swapping each seed), so
both see the same shared, noisy machine; ``load_1m`` is printed with every figure. Per run: the median time
per step, the time and step at which the 10-step mean reward first reaches ``--threshold`` (time from the first
training step's start, so loading is not counted on either side), peak RSS and CPU time (``wait4`` on the run's
process), the final 10-step mean reward.

The second table (``--modes``, default ``one_step,fully_async``): rollflow's asynchronous schedules on the
same race, beside the same invocation's TRL runs. TRL 1.16's asynchronous trainer
(``trl.experimental.async_grpo``) generates on a vLLM server only, so it is not raced on a CPU machine.

Prints one JSON line per run, then one summary line per rollflow mode, its medians over the seeds and the
ratios rollflow / TRL:
{"benchmark": "peer_trl", "side": "rollflow", "mode": "sync", "seed": 0, "steps": 200,
 "step_time_median_s": ..., "generation_time_median_s": ..., "time_to_threshold_s": ..., "steps_to_threshold":
 ..., "peak_rss_mib": ..., "cpu_s": ..., "wall_s": ..., "final_reward": ..., "load_1m": ...}
{"benchmark": "peer_trl", "summary": true, "mode": "sync", "baseline": "trl", "step_time_ratio": ..., ...}

Usage: ``python -m pip install 'rollflow[bench]'`` (TRL), then ``python benchmarks/peer_trl.py [--steps 200]
[--seeds 0,1,2] [--modes one_step,fully_async]``; ``--steps 20 --seeds 0 --modes ''`` is a short check (the
threshold is then usually not reached: its figures are null). About 1.5 minutes per run at 200 steps on 2 quiet
CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quickstart import quickstart_command, read_metrics, run_measured

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS = 400
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 8
LEARNING_RATE = 1e-3
WINDOW = 10  # steps in the reward's moving mean
RUN_NAME = "peer"


def write_setup(directory: Path) -> tuple[Path, Path]:
    """The model directory (a copy of the embedded tiny model's files) and the case task's JSONL."""
    from rollflow.models.tiny import ensure_tiny_model
    from rollflow.rollout.tasks import CaseTask

    model_dir = directory / "tiny-qwen3"
    shutil.copytree(ensure_tiny_model(), model_dir)
    task = CaseTask(0)
    rows = [{"prompt": task.item(i).messages, "answer": task.item(i).answer} for i in range(ROWS)]
    data = directory / "case.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data


# ------------------------------------------------------------------------------------------ the two sides


def run_rollflow(directory: Path, model_dir: Path, data: Path, steps: int, seed: int, mode: str) -> dict:
    overrides = [
        f"name={RUN_NAME}",
        f"seed={seed}",
        f"model.path='{model_dir}'",
        f"data.path='{data}'",
        "data.reward='case'",
        f"orchestrator.mode='{mode}'",
        f"orchestrator.steps={steps}",
        f"orchestrator.prompts_per_step={PROMPTS_PER_STEP}",
        f"sampling.samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"sampling.max_tokens={MAX_NEW_TOKENS}",
        "sampling.temperature=1.0",
        f"trainer.lr={LEARNING_RATE}",
        "trainer.loss_agg='token_mean'",
        "checkpoint.every=0",
    ]
    wall, peak, cpu = run_measured(quickstart_command(overrides), directory, f"rollflow {mode} seed {seed}")
    rows = read_metrics(directory, RUN_NAME)
    return {
        "rewards": [row["reward_mean"] for row in rows],
        # elapsed_s counts from the start of the first step (setup excluded), as the TRL side's clock does.
        "elapsed": [row["elapsed_s"] for row in rows],
        "step_times": [row["step_time_s"] for row in rows],
        "generation_times": [row["generation_time_s"] for row in rows],
        "wall": wall,
        "peak": peak,
        "cpu": cpu,
    }


def run_trl(directory: Path, model_dir: Path, data: Path, steps: int, seed: int) -> dict:
    out = directory / "trl_steps.jsonl"
    command = [
        sys.executable,
        __file__,
        "--trl-child",
        str(model_dir),
        str(data),
        str(out),
        str(steps),
        str(seed),
    ]
    wall, peak, cpu = run_measured(command, directory, f"trl seed {seed}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    elapsed = [row["elapsed_s"] for row in rows]
    return {
        "rewards": [row["reward"] for row in rows],
        "elapsed": elapsed,
        "step_times": [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)],
        "generation_times": [],
        "wall": wall,
        "peak": peak,
        "cpu": cpu,
    }


def trl_child(model_dir: str, data: str, out: str, steps: int, seed: int) -> None:
    """One TRL run, as its documentation has it, recording each step's end time and mean reward in ``out``."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rollflow.rollout.tasks import case_fraction

    def case_reward(completions, answer, **_):
        return [
            case_fraction(completion[0]["content"], case)
            for completion, case in zip(completions, answer, strict=True)
        ]

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "elapsed_s": time.perf_counter() - self.started}
                with open(out, "a") as sink:
                    sink.write(json.dumps({**row, "reward": logs["reward"]}) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.load_dataset("json", data_files=data, split="train")
    config = trl.GRPOConfig(
        output_dir=str(Path(out).parent / "trl-output"),
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
        num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        loss_type="dapo",
        beta=0.0,
        max_steps=steps,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=seed,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=case_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Recorder()],
    )
    trainer.train()


# ------------------------------------------------------------------------------------------ figures


def figures(side: str, mode: str, seed: int, steps: int, run: dict, threshold: float) -> dict:
    rewards, elapsed = run["rewards"], run["elapsed"]
    reached = None
    for step in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[step - WINDOW : step]) >= threshold:
            reached = step
            break
    generation = run["generation_times"]
    return {
        "benchmark": "peer_trl",
        "side": side,
        "mode": mode,
        "seed": seed,
        "steps": len(rewards),
        "step_time_median_s": round(statistics.median(run["step_times"]), 4),
        "generation_time_median_s": round(statistics.median(generation), 4) if generation else None,
        "threshold": threshold,
        "time_to_threshold_s": round(elapsed[reached - 1], 2) if reached else None,
        "steps_to_threshold": reached,
        "peak_rss_mib": round(run["peak"], 1),
        "cpu_s": round(run["cpu"], 2),
        "wall_s": round(run["wall"], 2),
        "final_reward": round(statistics.fmean(rewards[-WINDOW:]), 4),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def _median(lines: list[dict], key: str) -> float | None:
    values = [line[key] for line in lines if line[key] is not None]
    return statistics.median(values) if values else None


def summary(mode: str, ours: list[dict], trl: list[dict]) -> dict:
    line: dict = {"benchmark": "peer_trl", "summary": True, "mode": mode, "baseline": "trl"}
    for key, name in (
        ("step_time_median_s", "step_time"),
        ("time_to_threshold_s", "time_to_threshold"),
        ("steps_to_threshold", "steps_to_threshold"),
        ("peak_rss_mib", "peak_rss"),
        ("cpu_s", "cpu"),
    ):
        mine, theirs = _median(ours, key), _median(trl, key)
        line[f"rollflow_{key}"] = mine
        line[f"trl_{key}"] = theirs
        line[f"{name}_ratio"] = round(mine / theirs, 3) if mine is not None and theirs else None
    line["rollflow_generation_time_median_s"] = _median(ours, "generation_time_median_s")
    line["steps_to_threshold_per_seed"] = {
        "rollflow": [x["steps_to_threshold"] for x in ours],
        "trl": [x["steps_to_threshold"] for x in trl],
    }
    line["load_1m"] = round(os.getloadavg()[0], 2)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run per side each")
    parser.add_argument("--threshold", type=float, default=0.9, help="the 10-step mean reward to reach")
    parser.add_argument(
        "--modes",
        default="one_step,fully_async",
        help="rollflow's other schedules for the second table ('' none)",
    )
    args = parser.parse_args()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if bad := [mode for mode in modes if mode not in ("one_step", "fully_async")]:
        parser.error(f"--modes takes one_step and fully_async, got {bad}")
    if args.steps < 1 or not seeds:
        parser.error("--steps must be >= 1 and --seeds must name at least one seed")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: python -m pip install 'rollflow[bench]'") from None

    lines: dict[str, list[dict]] = {"trl": [], "sync": [], **{mode: [] for mode in modes}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_setup(Path(tmp))
        for index, seed in enumerate(seeds):
            order = ["sync", "trl", *modes] if index % 2 == 0 else ["trl", "sync", *reversed(modes)]
            for side in order:
                with tempfile.TemporaryDirectory(dir=tmp) as directory:
                    if side == "trl":
                        run = run_trl(Path(directory), model_dir, data, args.steps, seed)
                    else:
                        run = run_rollflow(Path(directory), model_dir, data, args.steps, seed, side)
                line = figures(
                    "trl" if side == "trl" else "rollflow", "sync" if side == "trl" else side, seed, args.steps,
                    run, args.threshold,
                )  # fmt: skip
                lines[side].append(line)
                print(json.dumps(line), flush=True)
    for mode in ["sync", *modes]:
        print(json.dumps(summary(mode, lines[mode], lines["trl"])), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--trl-child":
        trl_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
