"""Start-up check that each inference server reports the logprobs the trainer recomputes.

The trainer computes ``log_softmax(logits / temperature)``, renormalised over the tokens top-k/top-p kept
(``rollflow.train.losses``): vLLM's ``processed_logprobs``. vLLM's default, ``raw_logprobs``, is
``log_softmax(logits)`` before temperature and truncation, so a run against such a server trains on a ratio
that is off by the temperature and the truncated mass on every token (``--logprobs-mode`` exists since
vLLM 0.10.2; ``raw_logits`` and ``processed_logits`` are not logprobs at all).

The check asks each server for ``n = SAMPLES`` one-token samples of a fixed prompt with ``top_k = 2``:

- at the run's temperature, the two kept tokens' probabilities must sum to 1 (processed logprobs are
  renormalised over the kept set; raw ones sum to the pair's share of the whole vocabulary);
- at temperature 1 too (when the run's differs), and the gap between the two logprobs must scale as
  ``1 / temperature``: ``T * (lp_T(a) - lp_T(b)) = lp_1(a) - lp_1(b)``.

Both are properties of any model, so no reference forward is needed. When one token takes nearly all the
mass, the other is never drawn and the check cannot conclude: it logs a warning and lets the run start (a
distribution that peaked is also one where the modes differ least). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import aiohttp
import structlog

from rollflow.errors import ConfigError

log = structlog.get_logger(__name__)

# A prompt of low token ids, valid in every vocabulary.
CHECK_PROMPT = [1, 2, 3, 4]
# One-token samples per temperature: with the second token at 10% or more, it is drawn with probability
# 1 - 0.9**16 > 0.8.
SAMPLES = 16
# |log(p_a + p_b)| allowed for two renormalised probabilities (float32 arithmetic gives ~1e-7).
SUM_TOLERANCE = 1e-3
# Allowed gap between ``T * (lp_T(a) - lp_T(b))`` and ``lp_1(a) - lp_1(b)``: two requests may see slightly
# different logits (bf16 kernels, another batch), so an absolute part and a relative part.
SCALE_TOLERANCE = (0.05, 0.05)
FIX = (
    "start vLLM with --logprobs-mode processed_logprobs (rollflow starts its own vLLM servers with it; "
    "`rollflow serve` defaults to it)"
)


async def check_server_logprobs(
    server_urls: Sequence[str],
    temperature: float,
    *,
    api_key: str | None = None,
    model: str | None = None,
    timeout_s: float = 120.0,
    top_p: float = 1.0,
) -> None:
    """Check every server in ``server_urls`` (see the module docstring), one after the other.

    Args:
        server_urls: base URLs of vLLM-compatible servers (``/v1/completions`` with ``top_k``, ``n`` and
            ``return_token_ids``).
        temperature: the run's sampling temperature (0 checks at temperature 1 only).
        api_key: bearer token of the servers.
        model: the ``model`` field of the requests (None: the server's default).
        timeout_s: limit of each request.
        top_p: the run's ``sampling.top_p``: below 1, a server that records no kept sets (vLLM) is warned
            about, since the trainer cannot replay its top-p sets (``trainer.sampling_mask``).

    Raises:
        ConfigError: a server's logprobs are not the sampling distribution's; the message names the server,
            the figures and the flag.
        aiohttp.ClientError: a server could not be reached or answered an error.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    temperatures = [1.0] if temperature in (0.0, 1.0) else [temperature, 1.0]
    async with aiohttp.ClientSession(
        headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as session:
        for url in server_urls:
            results = [await _draw(session, url.rstrip("/"), t, model) for t in temperatures]
            draws = [draw for draw, _ in results]
            if top_p < 1.0 and not all(records for _, records in results):
                log.warning(
                    "server records no top-p kept sets (kept_counts): its top-p tokens train on the full softmax",
                    server=url,
                    top_p=top_p,
                )
            problem = logprob_problem(dict(zip(temperatures, draws, strict=True)))
            if problem == "inconclusive":
                log.warning(
                    "server logprob check inconclusive: one token took nearly all the mass",
                    server=url,
                    draws={str(t): d for t, d in zip(temperatures, draws, strict=True)},
                )
            elif problem is not None:
                raise ConfigError(
                    f"inference server {url} does not report the logprobs rollflow trains on "
                    f"(log_softmax(logits / temperature) over the tokens top-k/top-p kept): {problem}; {FIX}"
                )
            else:
                log.info("server logprobs match the trainer's", server=url, temperature=temperature)


async def _draw(
    session: aiohttp.ClientSession, url: str, temperature: float, model: str | None
) -> tuple[dict[int, float], bool]:
    """``{token: logprob}`` of ``SAMPLES`` one-token samples with ``top_k = 2`` at ``temperature``, and
    whether the server recorded their kept sets (``kept_counts``: rollflow's servers do, vLLM does not)."""
    payload: dict[str, Any] = {
        "prompt": CHECK_PROMPT,
        "max_tokens": 1,
        "temperature": temperature,
        "top_k": 2,
        "n": SAMPLES,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if model is not None:
        payload["model"] = model
    async with session.post(f"{url}/v1/completions", json=payload) as response:
        body = await response.json(content_type=None)
        if response.status != 200:
            raise aiohttp.ClientResponseError(
                response.request_info,
                (),
                status=response.status,
                message=f"logprob check request to {url}/v1/completions failed: {str(body)[:300]}",
            )
    draws: dict[int, float] = {}
    for choice in body["choices"]:
        token = int(choice["token_ids"][0])
        draws.setdefault(token, float(choice["logprobs"]["token_logprobs"][0]))
    return draws, all("kept_counts" in choice for choice in body["choices"])


def logprob_problem(draws: dict[float, dict[int, float]]) -> str | None:
    """What is wrong with ``{temperature: {token: logprob}}`` draws of a ``top_k = 2`` request: a sentence,
    ``"inconclusive"`` when a temperature drew one token only, or None when they are processed logprobs."""
    if any(len(tokens) < 2 for tokens in draws.values()):
        return "inconclusive"
    pairs = {}
    for temperature, tokens in draws.items():
        (a, lp_a), (b, lp_b) = sorted(tokens.items())[:2]
        total = math.log(math.exp(lp_a) + math.exp(lp_b))
        if abs(total) > SUM_TOLERANCE:
            return (
                f"at temperature {temperature:g} with top_k = 2 the two kept tokens {a} and {b} have logprobs "
                f"{lp_a:.4f} and {lp_b:.4f}, whose probabilities sum to {math.exp(total):.4f} instead of 1 "
                "(logprobs before top-k/top-p, as vLLM's default raw_logprobs mode returns)"
            )
        pairs[temperature] = (a, b, lp_a - lp_b)
    if len(pairs) == 2:
        (t_run, (a, b, gap_run)), (_, (a1, b1, gap_1)) = sorted(
            pairs.items(), key=lambda item: item[0] == 1.0
        )
        absolute, relative = SCALE_TOLERANCE
        if (a, b) == (a1, b1) and abs(t_run * gap_run - gap_1) > absolute + relative * abs(gap_1):
            return (
                f"the logprob gap between tokens {a} and {b} is {gap_run:.4f} at temperature {t_run:g} and "
                f"{gap_1:.4f} at temperature 1; tempered logprobs give {gap_1 / t_run:.4f} at {t_run:g} "
                "(logprobs before temperature, as vLLM's default raw_logprobs mode returns)"
            )
    return None
