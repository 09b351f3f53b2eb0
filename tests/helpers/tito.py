"""Helpers of the TITO tests: the tiny model's tokenizer and renderer (the ``tiny_chat`` fixture, registered
in tests/conftest.py), and a scripted client for tests that need chosen completions (tool calls, delays,
failures). The real model is behind ``inference_client`` (tests/conftest.py), in the suite's inference mode."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from rollflow.messages import FinishReason, GenerateOutput, GenerateRequest
from rollflow.tito.testing import TinyChat, as_history_message, make_session  # noqa: F401 - re-exported

MODEL = "rollflow:tiny"
# The JSON schema of the tool the TITO tests call: ``add(a, b)`` of two integers.
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="session")
def tiny_chat(tiny_model_dir) -> TinyChat:
    from rollflow.tito.testing import load_tiny_chat

    return load_tiny_chat(tiny_model_dir)


class ScriptedClient:
    """An ``InferenceClient`` whose completions are chosen texts, tokenized and closed with the stop token.

    Logprobs are unique per call (``-(call + 1) - position / 1000``) so tests can tell calls apart.
    """

    def __init__(
        self,
        tokenizer: Any,
        reply: Callable[[int, GenerateRequest], str] | None = None,
        *,
        delay_s: float = 0.0,
        stop_token_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.reply = reply or (lambda call, request: f"reply {call}")
        self.delay_s = delay_s
        self.stop_token_id = (
            stop_token_id if stop_token_id is not None else tokenizer.convert_tokens_to_ids("<|im_end|>")
        )
        self.requests: list[GenerateRequest] = []
        self.outputs: list[GenerateOutput] = []
        self.cancelled = 0
        self._calls = itertools.count()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        call = next(self._calls)
        self.requests.append(request)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = [
            *self.tokenizer.encode(self.reply(call, request), add_special_tokens=False),
            self.stop_token_id,
        ]
        finish = FinishReason.STOP
        if len(ids) > request.sampling.max_tokens:
            ids, finish = ids[: request.sampling.max_tokens], FinishReason.LENGTH
        output = GenerateOutput(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[-(call + 1) - i / 1000 for i in range(len(ids))],
            finish_reason=finish,
            policy_versions=[call] * len(ids),
            prompt_len=len(request.prompt_token_ids),
        )
        self.outputs.append(output)
        return output

    async def pause(self, mode: str = "abort") -> None: ...
    async def resume(self) -> None: ...
    async def is_paused(self) -> bool:
        return False

    async def update_named_weights(self, named_tensors: Any, policy_version: int) -> None: ...
    async def get_world_size(self) -> int:
        return 1

    async def close(self) -> None: ...


async def ask(session: Any, messages: list[dict], **fields: Any) -> Any:
    """Send one request straight to a session; returns the recorded ``Turn`` (the first, for ``n > 1``)."""
    import msgspec

    from rollflow.tito.wire import ChatCompletionRequest, validate_request

    request = msgspec.convert({"model": MODEL, "messages": messages, **fields}, ChatCompletionRequest)
    validate_request(request)
    return (await session.complete(request))[0]


class ScriptedPolicy:
    """The real engine, with chosen replies forced on the calls a script names: ``script(call, request)``
    returns the text to force (tokenized, closed with the stop token, streamed a few tokens at a time), or
    None to let the tiny model sample. Agents' tool calls are then deterministic while the other turns are
    real samples. Every call's prompt and output are kept (``calls``) for parity checks."""

    def __init__(self, inner: Any, tokenizer: Any, script: Callable[[int, GenerateRequest], str | None]):
        self.inner = inner
        self.forced = ScriptedClient(tokenizer, lambda call, request: script(call, request) or "")
        self.script = script
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt, sampled ids as returned)
        self._calls = itertools.count()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        from rollflow.inference.client import collect_stream

        return await collect_stream(self.generate_stream(request))

    async def generate_stream(self, request: GenerateRequest):
        from rollflow.messages import GenerateChunk

        call = next(self._calls)
        record: tuple[list[int], list[int]] = (list(request.prompt_token_ids), [])
        self.calls.append(record)
        if self.script(call, request) is None:
            async with contextlib.aclosing(self.inner.generate_stream(request)) as chunks:
                async for chunk in chunks:
                    record[1].extend(chunk.token_ids)
                    yield chunk
            return
        output = await self.forced.generate(request)
        for start in range(0, len(output.token_ids), 3):
            end = start + 3
            done = end >= len(output.token_ids)
            record[1].extend(output.token_ids[start:end])
            yield GenerateChunk(
                output.request_id,
                output.token_ids[start:end],
                output.logprobs[start:end],
                output.policy_versions[start:end],
                output.finish_reason if done else None,
                output.prompt_len,
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def assert_parity(
    trace: Any, calls: list[tuple[list[int], list[int]]], stops: list[str] = (), decode: Any = None
) -> int:
    """Composed samples train exactly the sampled tokens, each once, each after the exact prompt it was
    sampled from: every run of trainable tokens is the output of one engine call and what precedes it in the
    sample is that call's prompt. A run shorter than its call's output must end exactly where a stop string
    (``stops``, matched on ``decode``'s text) completes. Returns the trainable-token count."""
    from rollflow.tito import compose

    claimed: list[int] = []
    trained = 0
    for sample in compose(trace, reward=1.0, mode="per_branch", max_seq_len=100_000):
        full = sample.prompt_token_ids + sample.completion_token_ids
        offset = len(sample.prompt_token_ids)
        mask = sample.loss_mask
        i = 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            end = i
            while end < len(mask) and mask[end]:
                end += 1
            start = offset + i
            segment = full[start : offset + end]
            matches = [
                c
                for c, (prompt, output) in enumerate(calls)
                if output[: len(segment)] == segment and full[:start] == prompt
            ]
            assert matches, (
                f"trainable tokens {segment[:8]}… at {start} are no call's output after its prompt"
            )
            call = next((c for c in matches if c not in claimed), matches[0])
            if len(segment) < len(calls[call][1]):  # cut short: exactly where a stop string completes
                assert any(stop in decode(segment) for stop in stops), decode(segment)
                assert not any(stop in decode(segment[:-1]) for stop in stops), decode(segment)
            claimed.append(call)
            trained += len(segment)
            i = end
    assert sorted(claimed) == [c for c, (_, ids) in enumerate(calls) if ids], "each call trained exactly once"
    return trained


def assert_logprobs_recomputed(trace: Any, model_dir: Any) -> int:
    """Every trainable token of every composed sample (both modes) has the logprob the tiny model itself gives
    it after exactly the tokens before it: the trace holds exactly what was sampled. Returns the tokens checked."""
    import torch

    from rollflow.models.loading import load_causal_lm
    from rollflow.tito import compose

    model = load_causal_lm(model_dir)
    checked = 0
    for mode in ("per_branch", "step_wise"):
        for sample in compose(trace, reward=1.0, mode=mode, max_seq_len=100_000):
            ids = sample.prompt_token_ids + sample.completion_token_ids
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float()[:-1], dim=-1)
            offset = len(sample.prompt_token_ids)
            for i, (token, recorded, trained) in enumerate(
                zip(sample.completion_token_ids, sample.logprobs, sample.loss_mask, strict=True)
            ):
                if trained:
                    assert abs(logprobs[offset + i - 1, token].item() - recorded) < 1e-4, (mode, i)
                    checked += 1
    return checked


def tool_call_text(name: str, **arguments: Any) -> str:
    """The text the tiny model's template parses as one call of ``name`` (what a script has it sample)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@contextlib.asynccontextmanager
async def scripted_tito_proxy(tiny_chat: TinyChat, **options: Any) -> AsyncIterator[Any]:
    """A TITO proxy over a ``ScriptedClient`` (``proxy.scripted``), for tests of what the proxy refuses and
    answers without the model; small bodies (``max_body_bytes=4096``) unless ``options`` say otherwise."""
    from rollflow.tito import TITOProxy

    client = ScriptedClient(tiny_chat.tokenizer)
    options.setdefault("max_body_bytes", 4096)
    async with TITOProxy(
        client, tiny_chat.renderer, tiny_chat.tokenizer, model_name=MODEL, **options
    ) as proxy:
        proxy.scripted = client
        yield proxy
