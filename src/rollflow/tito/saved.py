"""Agent traces kept with a run (``agent.save_traces``): one JSON line per session's message tree.

``{run_dir}/traces/p{prompt_index:06d}.jsonl`` holds the saved trajectories of one prompt's group, written
whole (under a temporary name, then renamed) once the group is done, so a resumed run that redoes a prompt
replaces its file instead of appending to it. Each line is ``Trace.to_dict()`` (nodes with their token ids,
logprobs and per-token policy versions; turns with how each was rendered and why, fork positions, request
options) plus where the trajectory sits, its reward and outcome, its ``branches`` (node ids, root to leaf)
and ``forks`` (nodes with more than one child). ``rollflow trace RUN`` renders one (``trace_page``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from rollflow.errors import ConfigError
from rollflow.tito.trace import Trace

SAVE_TRACES = ("none", "sampled", "all")
TRACES_DIR = "traces"


def trace_record(
    trace: Trace,
    *,
    reward: float,
    prompt_index: int,
    sample_index: int,
    mask_reason: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """A session's trace as plain data for a JSON line (see the module docstring); ``model``: the served
    model (its tokenizer decodes the tokens on the trace's page)."""
    record = trace.to_dict()
    children: dict[int, int] = {}
    for node in record["nodes"]:
        children[node["parent"]] = children.get(node["parent"], 0) + 1
    record.update(
        prompt_index=prompt_index,
        sample_index=sample_index,
        reward=reward,
        mask_reason=mask_reason,
        model=model,
        branches=[[node.id for node in branch] for branch in trace.branches()],
        forks=sorted(node for node, count in children.items() if count > 1),
    )
    return record


class TraceWriter:
    """Writes the saved trajectories of each group to ``{directory}/p{prompt_index:06d}.jsonl``.

    Args:
        directory: the run's ``traces`` directory (created here).
        save: ``sampled`` (the first trajectory of each group) or ``all``.

    Raises:
        ConfigError: the directory cannot be created or written (names ``agent.save_traces`` and the path).
    """

    def __init__(self, directory: str | os.PathLike[str], save: str):
        if save not in SAVE_TRACES[1:]:
            raise ConfigError(f"agent.save_traces must be one of {', '.join(SAVE_TRACES)}, got {save!r}")
        self.directory = Path(directory)
        self.save = save
        probe = self.directory / ".write-test"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ConfigError(
                f"agent.save_traces = {save!r}: cannot write traces to {self.directory}: {error}; make the run "
                "directory writable or set agent.save_traces = 'none'"
            ) from None

    def wants(self, sample_index: int) -> bool:
        """Whether the trajectory at ``sample_index`` of its group is saved."""
        return self.save == "all" or sample_index == 0

    def write_group(self, prompt_index: int, records: list[dict[str, Any]]) -> Path:
        """Blocking: write one group's records (replacing an earlier file of the same prompt).

        Raises:
            OSError: the file cannot be written.
        """
        path = self.directory / f"p{prompt_index:06d}.jsonl"
        temporary = path.with_name(path.name + ".tmp")
        encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
        temporary.write_bytes(b"".join(encoder.encode(record) + b"\n" for record in records))
        os.replace(temporary, path)
        return path


def _enc_hook(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def read_traces(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every saved trace under ``directory`` (a run's ``traces``), in prompt order.

    Raises:
        FileNotFoundError: no traces were saved there.
        ValueError: a line is not JSON.
    """
    files = sorted(Path(directory).glob("p*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no saved traces in {directory} (run with agent.save_traces = 'sampled' or 'all')"
        )
    decoder = msgspec.json.Decoder()
    records = []
    for file in files:
        for number, line in enumerate(file.read_bytes().splitlines(), start=1):
            if line.strip():
                try:
                    records.append(decoder.decode(line))
                except msgspec.DecodeError as error:
                    raise ValueError(f"{file}:{number}: not a JSON trace: {error}") from None
    return records
