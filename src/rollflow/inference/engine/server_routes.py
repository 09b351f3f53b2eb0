"""Data-plane handlers of the engine server: vLLM 0.33's token and OpenAI-compatible generation endpoints.

Each handler decodes its body (``server_protocol``), validates every value against the engine's limits (so bad
input is a 400 naming the field, never an engine failure), runs one engine request per prompt and sample, and
shapes the response as vLLM does (``stream: true`` on the OpenAI endpoints: SSE, see ``server_streaming``). A
handler cancelled by a client disconnect cancels its engine requests, which frees their KV-cache slots.

The work one request may ask for (its prompts x ``n`` sequences, and their prompt plus ``max_tokens`` tokens)
is bounded by the server's ``RequestLimits`` (``rollflow.inference.request_limits``): the sequence count is
checked before any prompt is tokenized or rendered, the token count before the engine sees the request.

Long inputs never stall the event loop: a prompt whose length alone proves it cannot fit ``max_model_len``
(token ids: their count; text: its characters, see ``rollflow.inference.prompt_limits``) is a 400 before it
is tokenized, and text or chats above ``OFFLOAD_CHARS`` are tokenized and rendered in a worker thread, so
``/health`` and other requests keep being served meanwhile.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from aiohttp import web

from rollflow.errors import CONTEXT_LENGTH_EXCEEDED, EngineDeadError, EngineError
from rollflow.inference.engine.server_protocol import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
    bad_request,
    context_length_exceeded,
    decode_body,
    engine_dead,
    engine_error,
)
from rollflow.inference.engine.server_streaming import check_stream_options, stream_chat, stream_completions
from rollflow.inference.prompt_limits import (
    OFFLOAD_CHARS,
    message_text_chars,
    prompt_too_long_message,
    rendered_chars,
)
from rollflow.inference.request_limits import REQUEST_TOO_LARGE, request_work_error
from rollflow.inference.routed_experts import pack_routed_experts
from rollflow.inference.session_ids import SessionIdError, check_body_session_id, session_id_from_raw_headers
from rollflow.inference.token_bytes import token_bytes
from rollflow.messages import (
    FinishReason,
    GenerateChunk,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    sampling_error,
)

if TYPE_CHECKING:
    from rollflow.inference.engine.server import EngineServer

# vLLM clamps -inf logprobs to this (JSON has no infinity).
CLAMPED_LOGPROB = -9999.0
MAX_N = 64
_INT64 = 2**63


def _json(payload: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), content_type="application/json")


def _kept_counts(output: GenerateOutput | GenerateChunk) -> dict[str, list[int]]:
    """The choice's ``kept_counts`` field (rollflow's extension: the sampler's kept count of each token, see
    ``GenerateOutput.kept_counts``), only when a token was cut, so untruncated responses stay vLLM's."""
    return {} if output.kept_counts is None else {"kept_counts": output.kept_counts}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else CLAMPED_LOGPROB


def _routed_experts(output: GenerateOutput) -> dict[str, Any] | None:
    """The output's routes in the packed wire form, or None when the engine does not record them."""
    return None if output.routed_experts is None else pack_routed_experts(output.routed_experts)


def _unsupported(**fields: tuple[Any, Any]) -> None:
    """400 for the first field whose value differs from the one value the torch engine supports."""
    for name, (value, supported) in fields.items():
        if value is not None and value != supported:
            raise bad_request(
                f"{name}={value!r} is not supported by the rollflow torch engine (only {supported!r})",
                name.rsplit(".", 1)[-1],
            )


def _penalties_and_stops(body: CompletionBody | ChatBody) -> dict[str, tuple[Any, Any]]:
    """The OpenAI sampling fields both text endpoints share that the torch engine does not implement, each with
    the one value it accepts (for ``_unsupported``)."""
    return {
        "min_p": (body.min_p or None, 0.0),
        "min_tokens": (body.min_tokens, 0),
        "repetition_penalty": (body.repetition_penalty, 1.0),
        "presence_penalty": (body.presence_penalty or None, 0.0),
        "frequency_penalty": (body.frequency_penalty or None, 0.0),
        "logit_bias": (body.logit_bias or None, None),
        "stop": (body.stop or None, None),
    }


@dataclass(slots=True)
class _Sampling:
    """Sampling values of one request, normalized across the three endpoints (``prefix`` names the fields)."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    prefix: str = ""


class DataPlane:
    """The data-plane handlers; they share the server's engine, tokenizer, renderer and pause state."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.engine = server.engine
        self.tokenizer = server.tokenizer

    # ------------------------------------------------------------------ validation and generation

    def _check_tokens(self, token_ids: list[int], param: str, *, prompt: bool = True) -> None:
        if not token_ids:
            raise bad_request(f"{param} is empty; pass at least one token id", param)
        max_model_len = self.engine.max_model_len
        if prompt and len(token_ids) >= max_model_len:  # before scanning them: a length is free
            raise context_length_exceeded(max_model_len, len(token_ids), param)
        vocab = self.engine.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise bad_request(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab})", param)

    def _params(self, spec: _Sampling, prompt_len: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per sample, after checking every value against the engine's limits."""
        p, max_model_len = spec.prefix, self.engine.max_model_len
        if not 1 <= spec.n <= MAX_N:
            raise bad_request(f"{p}n must be between 1 and {MAX_N}, got {spec.n}", "n")
        if prompt_len >= max_model_len:
            raise context_length_exceeded(max_model_len, prompt_len, "prompt")
        max_tokens = spec.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        elif max_tokens < 1:
            raise bad_request(f"{p}max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        elif prompt_len + max_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        problem = sampling_error(
            max_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k
        )
        if problem is not None:
            field, message = problem
            raise bad_request(f"{p}{message}", field)
        if spec.seed is not None and not 0 <= spec.seed < _INT64 - MAX_N:
            raise bad_request(f"{p}seed must be in [0, 2**63 - {MAX_N}), got {spec.seed}", "seed")
        bad_stop = [t for t in spec.stop_token_ids if not 0 <= t < _INT64]
        if bad_stop:
            raise bad_request(f"{p}stop_token_ids must be non-negative, got {bad_stop[0]}", "stop_token_ids")
        stop = list(spec.stop_token_ids)
        if not spec.ignore_eos:
            stop += [t for t in self.server.eos_token_ids if t not in stop]
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=spec.temperature,
                top_p=spec.top_p,
                top_k=spec.top_k if spec.top_k > 0 else -1,
                # Samples of one seeded request differ from each other but are each reproducible.
                seed=None if spec.seed is None else spec.seed + i,
                stop_token_ids=tuple(stop),
            )
            for i in range(spec.n)
        ]

    def _check_work(
        self,
        num_prompts: int,
        n: int,
        prompt_lens: list[int] | None = None,
        params: list[list[SamplingParams]] | None = None,
        *,
        prefix: str = "",
    ) -> None:
        """400 ``request_too_large`` for a request asking more than the server's ``RequestLimits``: call it
        with the prompt count and ``n`` before tokenizing or rendering, and with the prompts' lengths and
        sampling once they are known, before the engine sees anything."""
        if not 1 <= n <= MAX_N:  # first: a huge n is refused for what it is
            raise bad_request(f"{prefix}n must be between 1 and {MAX_N}, got {n}", "n")
        max_tokens = None if params is None else [samples[0].max_tokens for samples in params]
        problem = request_work_error(self.server.request_limits, num_prompts, n, prompt_lens, max_tokens)
        if problem is not None:
            message, param = problem
            raise bad_request(message, param, code=REQUEST_TOO_LARGE)

    async def _generate(
        self, request_id: str, jobs: list[tuple[list[int], SamplingParams]], session_id: str | None
    ) -> list[GenerateOutput]:
        """Run every (prompt, params) job on the engine concurrently, all under ``request_id``."""
        self.server.check_accepting()
        requests = [
            GenerateRequest(
                prompt_token_ids=prompt, sampling=params, request_id=request_id, session_id=session_id
            )
            for prompt, params in jobs
        ]
        try:
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))
        except EngineError as error:
            raise engine_error(error) from None
        except EngineDeadError as error:
            raise engine_dead(error) from None

    def _stop_reason(self, output: GenerateOutput, user_stop_ids: list[int]) -> int | None:
        if (
            output.finish_reason is FinishReason.STOP
            and output.token_ids
            and output.token_ids[-1] in user_stop_ids
        ):
            return output.token_ids[-1]
        return None  # vLLM: null on EOS, length and abort

    @staticmethod
    def _session_id(request: web.Request, body_session_id: str | None) -> str | None:
        """The request's session id, header first, decoded and bounded as the router does (a 400 if bad)."""
        try:
            return session_id_from_raw_headers(request.raw_headers) or check_body_session_id(body_session_id)
        except SessionIdError as error:
            raise bad_request(str(error), error.param) from None

    @staticmethod
    def _usage(prompt_tokens: int, outputs: list[GenerateOutput]) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in outputs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_chars(self, chars: int, param: str) -> None:
        """400 for text whose character count alone proves it cannot fit ``max_model_len`` tokens."""
        limit = self.server.max_prompt_chars
        if chars > limit:
            raise bad_request(
                prompt_too_long_message(chars, limit, self.engine.max_model_len),
                param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    async def _encode(self, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
        """Token ids of each text, after the character check; off the event loop when they are long."""
        for text in texts:
            self._check_chars(len(text), param)

        def encode() -> list[list[int]]:
            return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

        if sum(len(text) for text in texts) <= OFFLOAD_CHARS:
            return encode()
        # The fast tokenizers encode through encode_batch, which releases the interpreter lock.
        return await anyio.to_thread.run_sync(encode)

    # ------------------------------------------------------------------ /inference/v1/generate

    async def generate(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), GenerateBody)
        self.server.check_model(body.model)
        sp = body.sampling_params
        _unsupported(
            stream=(body.stream, False),
            output_mode=(body.output_mode, "tokens"),
            **{
                "sampling_params.logprobs": (sp.logprobs if sp.logprobs else None, 0),
                "sampling_params.prompt_logprobs": (sp.prompt_logprobs, None),
                "sampling_params.min_p": (sp.min_p, 0.0),
                "sampling_params.min_tokens": (sp.min_tokens, 0),
                "sampling_params.repetition_penalty": (sp.repetition_penalty, 1.0),
                "sampling_params.presence_penalty": (sp.presence_penalty, 0.0),
                "sampling_params.frequency_penalty": (sp.frequency_penalty, 0.0),
                "sampling_params.logit_bias": (sp.logit_bias or None, None),
                "sampling_params.stop": (sp.stop or None, None),
            },
        )
        if sp.logprobs is not None and sp.logprobs < 0:
            raise bad_request(f"sampling_params.logprobs must be >= 0, got {sp.logprobs}", "logprobs")
        self._check_work(1, sp.n, prefix="sampling_params.")
        self._check_tokens(body.token_ids, "token_ids")
        spec = _Sampling(
            n=sp.n,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            stop_token_ids=sp.stop_token_ids or [],
            ignore_eos=sp.ignore_eos,
            prefix="sampling_params.",
        )
        params = self._params(spec, len(body.token_ids))
        self._check_work(1, sp.n, [len(body.token_ids)], [params], prefix="sampling_params.")
        request_id = body.request_id or f"gen-{uuid.uuid4().hex}"
        outputs = await self._generate(
            request_id, [(body.token_ids, p) for p in params], self._session_id(request, body.session_id)
        )
        choices = []
        for index, output in enumerate(outputs):
            logprobs = None
            if sp.logprobs is not None:
                logprobs = {
                    "content": [
                        {"token_id": token, "logprob": _logprob(value), "top_logprobs": []}
                        for token, value in zip(output.token_ids, output.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": index,
                    "finish_reason": output.finish_reason.value,
                    "stop_reason": self._stop_reason(output, spec.stop_token_ids),
                    "token_ids": output.token_ids,
                    "logprobs": logprobs,
                    "routed_experts": _routed_experts(output),
                    "policy_versions": output.policy_versions,
                    **_kept_counts(output),
                }
            )
        return _json(
            {
                "request_id": request_id,
                "model": self.server.served_model_name,
                "created": int(time.time()),
                "output_mode": "tokens",
                "choices": choices,
                "usage": self._usage(len(body.token_ids), outputs),
                "prompt_logprobs": None,
                "prompt_token_ids": body.token_ids if body.return_token_ids else None,
                "kv_transfer_params": None,
            }
        )

    # ------------------------------------------------------------------ /v1/completions

    async def _completion_prompts(self, prompt: Any, add_special_tokens: bool, n: int) -> list[list[int]]:
        """``prompt`` as a list of token-id prompts: token ids, a batch of them, a string or strings. Their
        count times ``n`` is checked against the request limits before any is tokenized."""

        def is_ids(value: Any) -> bool:
            return isinstance(value, list) and all(type(t) is int for t in value)

        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        self._check_work(len(prompt) if batch else 1, n)
        if isinstance(prompt, str):
            prompts = await self._encode([prompt], add_special_tokens, "prompt")
        elif is_ids(prompt) and prompt:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
            prompts = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = await self._encode(prompt, add_special_tokens, "prompt")
        else:
            raise bad_request(
                "prompt must be a non-empty list of token ids, a list of such lists, a string or a list of strings",
                "prompt",
            )
        for prompt_ids in prompts:
            self._check_tokens(prompt_ids, "prompt")
        return prompts

    async def completions(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), CompletionBody)
        self.server.check_model(body.model)
        _unsupported(
            echo=(body.echo or None, False),
            logprobs=(body.logprobs if body.logprobs else None, 0),
            prompt_logprobs=(body.prompt_logprobs, None),
            **_penalties_and_stops(body),
        )
        check_stream_options(body.stream, body.stream_options)
        if body.logprobs is not None and body.logprobs < 0:
            raise bad_request(f"logprobs must be >= 0, got {body.logprobs}", "logprobs")
        prompts = await self._completion_prompts(body.prompt, body.add_special_tokens, body.n)
        spec = _Sampling(
            n=body.n,
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
        )
        per_prompt = [self._params(spec, len(p)) for p in prompts]
        self._check_work(len(prompts), spec.n, [len(p) for p in prompts], per_prompt)
        request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        jobs = [
            (prompt, params)
            for prompt, samples in zip(prompts, per_prompt, strict=True)
            for params in samples
        ]
        session_id = self._session_id(request, body.session_id)
        if body.stream:
            prompt_tokens = sum(len(p) for p in prompts)
            return await stream_completions(
                self, request, body, request_id, jobs, spec.stop_token_ids, session_id, prompt_tokens
            )
        outputs = await self._generate(request_id, jobs, session_id)
        skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
        choices = []
        for index, ((prompt, _), output) in enumerate(zip(jobs, outputs, strict=True)):
            text = self._decode(output.token_ids, skip_special)
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": output.finish_reason.value,
                "stop_reason": self._stop_reason(output, spec.stop_token_ids),
                "prompt_logprobs": None,
                "policy_versions": output.policy_versions,
                **_kept_counts(output),
            }
            if body.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs(output, bool(body.return_tokens_as_token_ids))
            if body.return_token_ids:
                choice["token_ids"] = output.token_ids
                choice["prompt_token_ids"] = prompt
            if output.routed_experts is not None:
                choice["routed_experts"] = _routed_experts(output)
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts)
        return _json(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.server.served_model_name,
                "choices": choices,
                "usage": self._usage(prompt_tokens, outputs),
            }
        )

    def _completion_logprobs(
        self, output: GenerateOutput | GenerateChunk, as_token_ids: bool
    ) -> dict[str, Any]:
        if as_token_ids:
            tokens = [f"token_id:{t}" for t in output.token_ids]
        else:
            tokens = [self._decode([t], False) for t in output.token_ids]
        values = [_logprob(v) for v in output.logprobs]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            # logprobs=0: the sampled token only.
            "top_logprobs": [{token: value} for token, value in zip(tokens, values, strict=True)],
        }

    # ------------------------------------------------------------------ /v1/chat/completions

    async def _render(
        self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool
    ) -> list[int]:
        renderer = self.server.renderer
        if renderer is None:
            raise bad_request(
                f"chat is unavailable: no chat renderer for model {self.server.served_model_name!r}"
            )
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise bad_request(f"messages[{index}].role must be a string", "messages")
            content = message.get("content")
            if not (content is None or isinstance(content, str | list)):
                raise bad_request(
                    f"messages[{index}].content must be a string, a list of content parts or null, "
                    f"got {type(content).__name__}",
                    "messages",
                )
        chars = message_text_chars(messages)
        self._check_chars(chars, "messages")
        lock = self.server.render_lock

        def render() -> list[int]:
            return list(
                renderer.render_ids(messages, tools=tools, add_generation_prompt=add_generation_prompt)
            )

        def render_locked() -> list[int]:
            with lock:
                return render()

        try:
            # Inline while small and no large render holds the renderer; else in a worker thread. Small counts
            # everything rendered (assistant turns, tool calls, tool definitions), not only the refusal's text.
            if rendered_chars(messages, tools) <= OFFLOAD_CHARS and lock.acquire(blocking=False):
                try:
                    return render()
                finally:
                    lock.release()
            return await anyio.to_thread.run_sync(render_locked)
        except Exception as error:  # the renderer validates the conversation; its errors are the caller's
            raise bad_request(
                f"could not render messages: {type(error).__name__}: {error}", "messages"
            ) from None

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), ChatBody)
        self.server.check_model(body.model)
        _unsupported(
            top_logprobs=(body.top_logprobs or None, 0),
            continue_final_message=(body.continue_final_message or None, False),
            chat_template=(body.chat_template, None),
            **_penalties_and_stops(body),
        )
        check_stream_options(body.stream, body.stream_options)
        if not body.messages:
            raise bad_request("messages is empty; pass at least one message", "messages")
        n = 1 if body.n is None else body.n
        self._check_work(1, n)
        prompt = await self._render(body.messages, body.tools, body.add_generation_prompt)
        self._check_tokens(prompt, "messages")
        stop_ids = list(body.stop_token_ids or [])
        if not body.ignore_eos:
            stop_ids += [t for t in self.server.renderer.get_stop_token_ids() if t not in stop_ids]
        spec = _Sampling(
            n=n,
            max_tokens=body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
        )
        params = self._params(spec, len(prompt))
        self._check_work(1, n, [len(prompt)], [params])
        request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [(prompt, p) for p in params]
        session_id = self._session_id(request, body.session_id)
        user_stop_ids = list(body.stop_token_ids or [])
        if body.stream:
            return await stream_chat(self, request, body, request_id, prompt, jobs, user_stop_ids, session_id)
        outputs = await self._generate(request_id, jobs, session_id)
        choices = []
        for index, output in enumerate(outputs):
            choice: dict[str, Any] = {
                "index": index,
                "message": self._message(prompt, output, body.tools),
                "logprobs": None,
                "finish_reason": output.finish_reason.value,
                "stop_reason": self._stop_reason(output, user_stop_ids),
                "policy_versions": output.policy_versions,
                **_kept_counts(output),
            }
            if choice["message"].get("tool_calls") and output.finish_reason is FinishReason.STOP:
                choice["finish_reason"] = "tool_calls"
            if body.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(output)}
            if body.return_token_ids:
                choice["token_ids"] = output.token_ids
            if output.routed_experts is not None:
                choice["routed_experts"] = _routed_experts(output)
            choices.append(choice)
        response: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.server.served_model_name,
            "choices": choices,
            "usage": self._usage(len(prompt), outputs),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt
        return _json(response)

    def _chat_logprobs(self, output: GenerateOutput | GenerateChunk) -> list[dict[str, Any]]:
        content = []
        for token, value in zip(output.token_ids, output.logprobs, strict=True):
            text = self._decode([token], False)
            content.append(
                {
                    "token": text,
                    "logprob": _logprob(value),
                    "bytes": token_bytes(self.tokenizer, token, text),
                    "top_logprobs": [],
                }
            )
        return content

    def _message(self, prompt: list[int], output: GenerateOutput, tools: Any) -> dict[str, Any]:
        try:
            parsed = self.server.renderer.parse_response(output.token_ids, tools=tools, prompt_ids=prompt)
        except Exception:  # a truncated or aborted reply may not parse: fall back to its plain text
            return {"role": "assistant", "content": self._decode(output.token_ids, True)}
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        calls = [c for c in parsed.tool_calls if getattr(c.status, "name", "OK") == "OK" and c.name]
        if calls:
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments
                        if isinstance(call.arguments, str)
                        else msgspec.json.encode(call.arguments or {}).decode(),
                    },
                }
                for call in calls
            ]
        return message

    # ------------------------------------------------------------------ tokenizer and models

    async def tokenize(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), TokenizeBody)
        self.server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("pass exactly one of prompt (text) or messages (chat)", "prompt")
        if body.prompt is not None:
            [tokens] = await self._encode([body.prompt], body.add_special_tokens, "prompt")
        else:
            if not body.messages:
                raise bad_request("messages is empty; pass at least one message", "messages")
            tokens = await self._render(body.messages, body.tools, body.add_generation_prompt)
        response: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.engine.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            response["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return _json(response)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), DetokenizeBody)
        self.server.check_model(body.model)
        if body.tokens:
            self._check_tokens(body.tokens, "tokens", prompt=False)
        if len(body.tokens) <= OFFLOAD_CHARS // 8:
            return _json({"prompt": self._decode(body.tokens, False)})
        return _json({"prompt": await anyio.to_thread.run_sync(self._decode, body.tokens, False)})

    async def models(self, request: web.Request) -> web.Response:
        server = self.server
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.served_model_name,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "rollflow",
                        "root": server.model_path,
                        "parent": None,
                        "max_model_len": self.engine.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )
