"""Helpers of the agent-harness tests (tests/test_agent_harnesses.py): where the installed CLIs are, a proxy
that keeps each request's status, and the checks every episode must pass, as one row of the acceptance table.

The CLIs are installed by ``scripts/install_agent_clis.sh`` into ``$ROLLFLOW_AGENT_CLI_DIR`` (else
``.agent-clis/`` in the repository); CI runs it, so there they run."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollflow.tito import TITOProxy, compose

REPO_ROOT = Path(__file__).resolve().parents[2]
# A harness's episode as one row: where it goes when $ROLLFLOW_HARNESS_TABLE names a file (JSON lines).
TABLE_ENV = "ROLLFLOW_HARNESS_TABLE"
# Model calls, as opposed to count_tokens, /models and the harnesses' probes of their base URL.
MODEL_CALL_SUFFIXES = ("/chat/completions", "/responses", "/messages")


def cli_dir() -> Path:
    return Path(os.environ.get("ROLLFLOW_AGENT_CLI_DIR") or REPO_ROOT / ".agent-clis")


def cli_path(name: str) -> Path | None:
    """The installed CLI ``name`` (``codex``, ``claude``, ``opencode``), or None."""
    path = cli_dir() / "node_modules" / ".bin" / name
    return path if path.exists() else None


class RecordingProxy(TITOProxy):
    """A ``TITOProxy`` that keeps (method, path suffix, status, model) of every request it answered: the
    harness tests count refused requests and model calls from it. Serving is the proxy's own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.answered: list[tuple[str, str, int, str | None]] = []

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response = await super()._errors(request, handler)
        model = None
        if request.method == "POST" and request.can_read_body:
            with contextlib.suppress(ValueError, AttributeError):
                model = json.loads(await request.read()).get("model")
        suffix = request.path.partition("/v1")[2] or request.path.rpartition("/")[2]
        self.answered.append((request.method, suffix, response.status, model))
        return response

    async def _answer_fast(self, front: Any, turn_request: Any, answer: Any) -> None:
        """The turns the listener's front answers (non-streamed ones), recorded as the middleware records
        aiohttp's."""
        status = 200

        async def watched() -> Any:
            nonlocal status
            try:
                return await answer
            except Exception as error:
                status = turn_request.error_answer(error)[0]
                raise

        await super()._answer_fast(front, turn_request, watched())
        suffix = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
        self.answered.append(("POST", suffix[turn_request.api], status, turn_request.decoded.request.model))

    def model_calls(self) -> list[tuple[str, str, int, str | None]]:
        return [a for a in self.answered if a[0] == "POST" and a[1].endswith(MODEL_CALL_SUFFIXES)]

    def refused(self) -> list[tuple[str, str, int, str | None]]:
        return [a for a in self.answered if a[2] >= 400]


@dataclass
class EpisodeRow:
    """One row of the acceptance table."""

    harness: str
    api: str
    streamed: bool
    calls: int = 0
    refused: int = 0
    trainable_tokens: int = 0
    max_abs_logprob_delta: float = 0.0
    side_calls: dict[str, int] = field(default_factory=dict)
    prompt_tokens_max: int = 0
    exit_code: int | None = None

    def write(self) -> None:
        print("harness row:", json.dumps(asdict(self)))
        path = os.environ.get(TABLE_ENV)
        if path:
            with open(path, "a") as out:
                out.write(json.dumps(asdict(self)) + "\n")


def recompute_trainable(trace: Any, model: Any) -> tuple[int, float]:
    """(trainable tokens, max |recorded - recomputed| logprob) over the composed samples of ``trace``: each
    sample's tokens run once through ``model`` (transformers, the same weights the engine served)."""
    import torch

    checked, worst = 0, 0.0
    for sample in compose(trace, reward=1.0, mode="per_branch", max_seq_len=10**7):
        if not any(sample.loss_mask):
            continue
        ids = sample.prompt_token_ids + sample.completion_token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(sample.prompt_token_ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, (token, recorded, trained) in enumerate(
            zip(sample.completion_token_ids, sample.logprobs, sample.loss_mask, strict=True)
        ):
            if trained:
                worst = max(worst, abs(logprobs[i, token].item() - recorded))
                checked += 1
    return checked, worst


def check_episode(row: EpisodeRow, proxy: RecordingProxy, trace: Any, model: Any) -> EpisodeRow:
    """The checks every harness episode passes (and the row they fill): no refused request, every model call
    answered is a turn of the trace, every trainable token's logprob recomputed within 1e-4, side calls'
    replies never trained."""
    calls = proxy.model_calls()
    row.calls, row.refused = len(calls), len(proxy.refused())
    row.side_calls = dict(trace.side_calls)
    row.prompt_tokens_max = max((turn.prompt_len for turn in trace.turns), default=0)
    assert proxy.refused() == [], proxy.refused()
    assert trace.errors == [] and trace.error is None
    assert calls and len(trace.turns) == len(calls), (len(trace.turns), calls)
    row.trainable_tokens, row.max_abs_logprob_delta = recompute_trainable(trace, model)
    assert row.trainable_tokens > 0 and row.max_abs_logprob_delta <= 1e-4, row
    side = [node for node in trace.nodes if node.id in trace.side_nodes]
    for sample in compose(trace, reward=1.0, mode="per_branch", max_seq_len=10**7):
        full = sample.prompt_token_ids + sample.completion_token_ids
        mask = [False] * len(sample.prompt_token_ids) + sample.loss_mask
        for node in side:  # where a sample holds a side call's reply, none of it is trained
            end = node.start + len(node.token_ids)
            if full[node.start : end] == node.token_ids.tolist():
                assert not any(mask[node.start + node.num_prompt : end]), "a side call's reply is trained"
    row.write()
    return row
