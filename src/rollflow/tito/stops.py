"""Stop strings, as vLLM applies them: the reply ends at the token whose text completes a stop string.

The engines stop on token ids only, so the proxy watches the text of the tokens as they are sampled
(``StopMatcher``): the token that completes a stop string is the last one kept (its id, logprob and policy
version are recorded and trained, like every sampled token before it); the tokens sampled after it are
dropped and the engine request is ended. The reply's text ends before the stop string, or after it with
``include_stop_str_in_output``. Text is decoded as vLLM does by default (special tokens skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollflow.inference.text_deltas import IncrementalDecoder


class StopMatcher:
    """Finds where the first stop string completes in a growing list of sampled token ids.

    Args:
        stops: the stop strings (non-empty).
        decode: token ids to text (the tokenizer's, special tokens skipped).
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self._longest = max(len(stop) for stop in self.stops)
        self._decoder = IncrementalDecoder(decode)
        self._token_ids: list[int] = []
        self._text = ""
        # The stop string that ended the reply, once one has.
        self.matched: str | None = None

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """Take the next sampled tokens; once a stop string completes, return how many of them to keep
        (the completing token included). None while no stop string has completed."""
        if self.matched is not None:
            return 0
        for kept, token_id in enumerate(token_ids, start=1):
            self._token_ids.append(token_id)
            delta = self._decoder.update(self._token_ids)
            if not delta:
                continue
            searched = max(0, len(self._text) - self._longest + 1)
            self._text += delta
            found = [
                (position, stop) for stop in self.stops if (position := self._text.find(stop, searched)) >= 0
            ]
            if found:
                self.matched = min(found)[1]
                return kept
        return None


def cut_at_stop(text: str, stop: str, *, include: bool) -> tuple[str, bool]:
    """``text`` up to the last occurrence of ``stop`` (with it when ``include``), and whether it was found."""
    position = text.rfind(stop)
    if position < 0:
        return text, False
    return text[: position + len(stop)] if include else text[:position], True


def hold_back(text: str, stops: Sequence[str]) -> str:
    """``text`` as a stream may send it while a stop string could still complete: cut at a complete stop
    string, and without a tail that begins one."""
    for stop in stops:
        position = text.find(stop)
        if position >= 0:
            text = text[:position]
    for length in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return text[:-length]
    return text
