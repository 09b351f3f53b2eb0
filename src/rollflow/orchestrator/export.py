"""``rollflow export``: one checkpoint of a run as a standalone Hugging Face model directory.

The output loads with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` and ``vllm serve``: the
weights in the chosen dtype (safetensors + ``config.json``), ``generation_config.json`` and the tokenizer files;
never the trainer's resume state (optimizer, RNG, sharded weights). It is written to a staging directory beside
the output and renamed into place, so an interrupted export leaves no half-written model at the output path.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import structlog

from rollflow.errors import CheckpointError, ConfigError, RollflowError
from rollflow.orchestrator.checkpoint import STATE_FILE, as_umask_allows, list_checkpoints, load_state

log = structlog.get_logger(__name__)

EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` values; ``auto`` keeps the checkpoint's own (the training dtype)."""


def find_checkpoint(run: str | Path, step: int | None = None) -> Path:
    """The checkpoint of ``run`` (a run directory, or one checkpoint directory) at ``step`` (None: the latest).

    Raises:
        CheckpointError: ``run`` does not exist, has no complete checkpoint, or none at ``step`` (the message
            lists the steps it has).
    """
    run = Path(run)
    if not run.exists():
        raise CheckpointError(f"run directory {run} does not exist")
    if (run / STATE_FILE).is_file():  # a checkpoint directory itself
        done = load_state(run).step
        if step is not None and step != done:
            raise CheckpointError(f"checkpoint {run} is of step {done}, not --step {step}")
        return run
    checkpoints = list_checkpoints(run)
    if not checkpoints:
        raise CheckpointError(
            f"{run} has no complete checkpoint under {run / 'checkpoints'} (is it a rollflow run directory? "
            "checkpoints are written every orchestrator.checkpoint_every steps)"
        )
    if step is None:
        return checkpoints[-1]
    by_step = {load_state(path).step: path for path in checkpoints}
    if step not in by_step:
        raise CheckpointError(
            f"--step {step}: {run} has no checkpoint of that step; it has steps "
            + ", ".join(str(s) for s in sorted(by_step))
        )
    return by_step[step]


def export_checkpoint(
    run: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    dtype: str = "auto",
    force: bool = False,
    merge: bool = False,
) -> dict[str, Any]:
    """Write checkpoint ``step`` of ``run`` (None: the latest) to ``out`` as a Hugging Face model directory.

    A checkpoint of a ``[trainer.lora]`` run holds an adapter (``adapter/``): it is written as the PEFT
    adapter directory (``PeftModel.from_pretrained(base, out)`` loads it), or with ``merge`` merged into its
    base model (``adapter_config.json``'s ``base_model_name_or_path``) as a plain model directory.

    Returns:
        ``{"path", "checkpoint", "step", "dtype"}`` of what was written (``"adapter": True`` for an adapter).

    Raises:
        CheckpointError: no such run or checkpoint (see ``find_checkpoint``), or its weights cannot be read.
        ConfigError: ``out`` exists and is not empty (pass ``force`` to replace it), or lies inside the
            checkpoint; ``dtype`` is not one of ``EXPORT_DTYPES``.
    """
    from rollflow.train.export import HF_DIR, save_hf_model

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not a dtype; use one of {', '.join(EXPORT_DTYPES)}")
    checkpoint = find_checkpoint(run, step)
    out = Path(out).expanduser()
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise ConfigError(f"export output {out} is inside the checkpoint {checkpoint}; pick another OUT")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export output {out} exists and is not a directory; pick another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"export output {out} exists and is not empty; pick another OUT, or pass --force to replace it"
        )
    adapter = checkpoint / "adapter"
    if (adapter / "adapter_config.json").is_file():
        return _export_adapter(checkpoint, adapter, out, dtype=dtype, merge=merge)
    if merge:
        raise ConfigError(
            f"--merge merges a LoRA adapter into its base, but checkpoint {checkpoint} holds full weights (its "
            "run had no [trainer.lora]); export it without --merge"
        )
    source = checkpoint / HF_DIR
    if not (source / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint} has no Hugging Face model directory {HF_DIR}/ (written by rollflow "
            "since checkpoints hold one); export a newer checkpoint"
        )
    model = _load(source, dtype)
    _write_staged(out, lambda staging: save_hf_model(model, staging, tokenizer_dir=source))
    written_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = {
        "path": str(out),
        "checkpoint": str(checkpoint),
        "step": load_state(checkpoint).step,
        "dtype": written_dtype,
    }
    log.info("exported", **result)
    return result


def _write_staged(out: Path, write: Any) -> None:
    """``write(staging)`` into a directory beside ``out``, then renamed to ``out``."""
    staging = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        as_umask_allows(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _export_adapter(checkpoint: Path, adapter: Path, out: Path, *, dtype: str, merge: bool) -> dict[str, Any]:
    """A LoRA checkpoint's adapter, as the PEFT directory or (``merge``) merged into its base."""
    import json

    from rollflow.train.export import save_hf_model

    result: dict[str, Any] = {
        "path": str(out),
        "checkpoint": str(checkpoint),
        "step": load_state(checkpoint).step,
    }
    if not merge:
        if dtype not in ("auto", "float32"):
            raise ConfigError(f"--dtype {dtype}: an adapter is exported as trained (float32); pass --merge")
        _write_staged(out, lambda staging: shutil.copytree(adapter, staging))
        log.info("exported", adapter=True, **result)
        return {**result, "dtype": "float32", "adapter": True}
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise CheckpointError(
            f"{adapter}/adapter_config.json names base model {base!r}, which is not a model directory here: "
            "--merge needs the base the adapter was trained on"
        )
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError("--merge needs the peft package: pip install 'rollflow[lora]'") from None
    model = _load(Path(base), "float32")
    targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules") or []
    if "lm_head" in targets and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        # Merging into a tied head would change the input embeddings too: the head gets its own weight.
        import torch

        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if dtype != "auto":
        import torch

        model = model.to(getattr(torch, dtype))
    _write_staged(out, lambda staging: save_hf_model(model, staging, tokenizer_dir=Path(base)))
    result["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    log.info("exported", merged=True, **result)
    return result


def _load(source: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.models.loading import _quiet_transformers

    _quiet_transformers()
    try:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype="auto" if dtype == "auto" else getattr(torch, dtype)
        ).eval()
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot load the model in {source}: {error}") from None


def push_to_hub(directory: str | Path, repo_id: str, *, private: bool = True) -> str:
    """Upload an exported model directory to the Hugging Face Hub repository ``repo_id`` (created if missing,
    private by default); returns the commit URL. Needs a token (``huggingface-cli login`` or ``HF_TOKEN``) and
    network access.

    Raises:
        ConfigError: ``HF_HUB_OFFLINE`` is set.
        RollflowError: the hub refused the upload or could not be reached (its message included).
    """
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set; unset it to upload (the export in {directory} is "
            "complete either way)"
        )
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(directory), repo_id=repo_id, commit_message="Upload model exported by rollflow"
        )
    except Exception as error:  # HfHubHTTPError and network errors; the export itself is done
        raise RollflowError(
            f"--push-to-hub {repo_id}: upload failed ({error}); the export in {directory} is complete, upload "
            "it again with `huggingface-cli upload`"
        ) from None
    with contextlib.suppress(AttributeError):
        return str(commit.commit_url)
    return str(commit)
