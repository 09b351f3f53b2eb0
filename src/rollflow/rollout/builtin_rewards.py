"""Built-in rewards, named in ``data.reward`` / ``data.rewards``: ``math``, ``exact`` and ``case``.

``math`` extracts the final answer of a completion (the last ``\\boxed{…}``, else the text after the last
``####``, else the last number) and the reference's (its ``\\boxed{}`` or ``####`` part, so a GSM8K
solution ending in ``#### 72`` works as the answer, else the whole reference), then compares them: equal after normalisation (commas, ``$``, units of
whitespace, trailing zeros, fractions as numbers), else equal for the ``math-verify`` library (symbolic and
LaTeX equivalence) when it is installed, skipped for answers whose evaluation could run away (long ones, big or
nested powers, big factorials). 1.0 or 0.0.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

from rollflow.rollout.callbacks import mark_inline
from rollflow.rollout.tasks import TaskItem, case_fraction

_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : position]
    return None


def marked_answer(text: str) -> str | None:
    """The answer a solution marks: the last ``\\boxed{}``, else the line after the last ``####``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last ``\\boxed{}``, else after the last ``####``, else the last
    number; None when there is none."""
    marked = marked_answer(text)
    if marked is not None:
        return marked
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalise(answer: str) -> str:
    """A canonical string for an answer: no ``$``, ``\\text{}``, commas between digits, spaces, or a trailing
    period; numbers as exact fractions (so ``0.50``, ``1/2`` and ``\\frac{1}{2}`` agree)."""
    text = answer.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", text)
    text = text.replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    number = text.removeprefix("+")
    if len(number) > 60 or not _PLAIN_NUMBER.fullmatch(number):  # no exponents: 1e999999999 would hang
        return text
    try:
        return str(Fraction(number))
    except ZeroDivisionError:
        return text


# sympy evaluates integer powers and factorials eagerly: ``9^{9^{9^{9}}}`` in a completion would hang the
# reward thread (math-verify's own timeout needs the main thread). Such answers skip the symbolic check.
_COSTLY = re.compile(r"\^[\s{(]*-?\d{3,}|\^.*\^|\d{4,}\s*!|\\(?:operatorname\{)?(?:fact|binom)")


def _math_verify_equal(gold: str, predicted: str) -> bool:
    if len(predicted) > 200 or _COSTLY.search(predicted) or _COSTLY.search(gold):
        return False
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # Its own timeouts use SIGALRM, which only the main thread may set; rewards run in worker threads.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    parsed_gold = parse(f"${gold}$", parsing_timeout=None)
    parsed_pred = parse(f"${predicted}$", parsing_timeout=None)
    return bool(parsed_gold and parsed_pred and verify(parsed_gold, parsed_pred, timeout_seconds=None))


def _reference(item: TaskItem) -> str:
    if item.answer is None:
        raise ValueError("the row has no answer (data.answer_key) to compare with")
    return str(item.answer)


def math_reward(completion: str, item: TaskItem) -> float:
    """1.0 when the completion's final answer equals the reference answer (see the module docstring)."""
    reference = _reference(item)
    gold = marked_answer(reference) or reference.strip()  # a plain reference is the answer as a whole
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    if normalise(predicted) == normalise(gold):
        return 1.0
    return 1.0 if _math_verify_equal(gold, predicted) else 0.0


@mark_inline
def exact_reward(completion: str, item: TaskItem) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer exactly."""
    return 1.0 if completion.strip() == _reference(item).strip() else 0.0


@mark_inline
def case_reward(completion: str, item: TaskItem) -> float:
    """The quickstart ``case`` task's reward: answer ``upper`` or ``lower``, the fraction of letters in it."""
    if item.answer not in ("upper", "lower"):
        raise ValueError(f"the case reward needs the answer 'upper' or 'lower', got {item.answer!r}")
    return case_fraction(completion, item.answer)


BUILTIN_REWARDS: dict[str, Any] = {"math": math_reward, "exact": exact_reward, "case": case_reward}
