"""``RequestLimits``: the most work one generation request may ask of ``rollflow serve``, checked in one place
(``request_work_error``) before any of it is done.

The work of a request is its sequences (prompts x ``n``: each holds a KV-cache slot and an engine queue entry)
and its tokens (per sequence, the prompt's tokens plus the ``max_tokens`` it may sample: what the engine may
compute and the response may carry). Without a bound, one small body asks for anything: 10,000 token-id prompts
x ``n = 64`` is a 40 KB body that queues 640,000 sequences. The server checks the sequence count before it
tokenizes or renders anything (a prompt count and ``n`` are free to read), and the token count once the prompts'
lengths are known, before the engine sees the request. Over either limit the request is a 400 whose message
names the limit and the ``rollflow serve`` flag that raises it.

``rollflow router`` checks the sequence count too (``sequences_asked``, its own ``--max-request-sequences``),
so servers that bound nothing themselves (vLLM) are not flooded through it either.

How the engine shares its batch between the requests it accepted is ``TorchEngine``'s fair scheduling.

Imports neither torch nor aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

# The ``code`` of the 400 a request over a limit gets.
REQUEST_TOO_LARGE = "request_too_large"
# ``RequestLimits.max_sequences`` by default, for ``rollflow serve`` and ``rollflow router`` alike.
DEFAULT_MAX_SEQUENCES = 256


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one generation request (``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``)
    may ask of ``rollflow serve``; the flags are ``--max-request-sequences`` and ``--max-request-tokens``.

    The defaults let any request of up to 256 sequences at a context of 2048 tokens through (4 prompts x
    ``n = 64``, or 256 prompts of one sample), what RL groups need, and refuse what only floods the queue.
    """

    # Sequences one request may ask for: its prompts times n.
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    # Tokens one request may ask for: over its sequences, prompt tokens plus max_tokens (the context left when
    # a request gives no max_tokens).
    max_tokens: int = 2**19

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def request_work_error(
    limits: RequestLimits,
    num_prompts: int,
    n: int,
    prompt_lens: list[int] | None = None,
    max_tokens: list[int] | None = None,
    *,
    limiter: str = "this server",
) -> tuple[str, str] | None:
    """``(message, param)`` when a request of ``num_prompts`` prompts, each sampled ``n`` times, asks for more
    than ``limits`` allow, else None.

    Without ``prompt_lens`` only the sequence count is checked: cheap, so the server calls it before
    tokenizing or rendering anything. With the prompts' token counts and each prompt's ``max_tokens`` (the
    context left when the request gives none) the token count is checked too. ``limiter`` is what the
    message names as setting the limit (``rollflow router`` passes "this router").
    """
    sequences = num_prompts * n
    if sequences > limits.max_sequences:
        return (
            f"this request asks for {sequences} sequences ({num_prompts} prompt(s) x n={n}), more than the "
            f"{limits.max_sequences} one request may ask of {limiter} (its --max-request-sequences); send "
            f"fewer prompts or a smaller n per request, or start {limiter.removeprefix('this ')} with a larger "
            "--max-request-sequences",
            "n" if num_prompts == 1 else "prompt",
        )
    if prompt_lens is None or max_tokens is None:
        return None
    total = n * sum(p + m for p, m in zip(prompt_lens, max_tokens, strict=True))
    if total <= limits.max_tokens:
        return None
    return (
        f"this request asks for up to {total} tokens ({len(prompt_lens)} prompt(s) of {sum(prompt_lens)} tokens "
        f"in all, x n={n}, each with its max_tokens), more than the {limits.max_tokens} one request may ask of "
        "this server (its --max-request-tokens); lower max_tokens, send fewer prompts or a smaller n per "
        "request, or start the server with a larger --max-request-tokens",
        "max_tokens",
    )


class _SamplingN(msgspec.Struct):
    n: int = 1


class _Work(msgspec.Struct):
    """The fields of a generation body that say how many sequences it asks for; every other one is skipped."""

    n: int = 1
    prompt: msgspec.Raw = msgspec.Raw(b"")  # absent: empty
    sampling_params: _SamplingN | None = None


# Where the sequence count lives, per generation path: prompts x n (completions), n (chat), sampling_params.n.
_COUNTED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/inference/v1/generate"))


def sequences_asked(path: str, body: bytes) -> tuple[int, int] | None:
    """``(prompts, n)`` a generation request to ``path`` asks for, or None for another path or a body that
    does not decode as one (the server answers it with its own error). Decodes only ``n``, ``prompt`` (its
    elements are counted, not read) and ``sampling_params.n``."""
    if path not in _COUNTED_PATHS:
        return None
    try:
        work = msgspec.json.decode(body, type=_Work)
    except (msgspec.DecodeError, RecursionError):
        return None
    if path == "/inference/v1/generate":
        return 1, work.sampling_params.n if work.sampling_params is not None else 1
    prompts = 1
    if path == "/v1/completions" and work.prompt:
        raw = bytes(work.prompt).lstrip()
        # A batch is a list of strings or of token-id lists; a single prompt is a string or a list of ids.
        if raw[:1] == b"[" and raw[1:].lstrip()[:1] in (b"[", b'"'):
            try:
                prompts = len(msgspec.json.decode(raw, type=list[msgspec.Raw]))
            except msgspec.DecodeError:
                return None
    return prompts, work.n


__all__ = [
    "DEFAULT_MAX_SEQUENCES",
    "REQUEST_TOO_LARGE",
    "RequestLimits",
    "request_work_error",
    "sequences_asked",
]
