"""Side calls: model calls an agent harness makes besides its loop (titles, summaries, topic checks), which are
answered like any call but never trained.

A ``SideCallRule`` (``[agent.side_calls]``) names them three ways, checked in this order:

- by model name: ``models`` holds names or ``fnmatch`` patterns (``"claude-3-5-haiku*"``); a call naming one of
  them is served by the run's model (rather than refused as an unknown model) and is a side call of kind
  ``model:<name>``;
- by header: a request carrying the header ``header`` is a side call of the kind its value names;
- by predicate: ``predicate`` (``package.module:function`` or ``path/file.py:function``) is called with a
  ``SideCallRequest`` and returns the kind (a string) or None for a trainable call.

The proxy records a side call's reply in the session's tree like any turn, marked non-trainable (its node and
turn carry the kind; the composer gives its tokens no loss), and counts it per kind (``Trace.side_calls``).
This module imports neither torch nor transformers.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollflow.imports import import_object
from rollflow.tito.wire import ChatCompletionRequest

# Kinds become metric names (``agent_side_calls_<kind>``): anything else is replaced by '_'.
_KIND_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_MAX_KIND_CHARS = 64


@dataclass(frozen=True, slots=True)
class SideCallRequest:
    """What a side-call predicate sees of a request."""

    api: str  # "chat", "responses" or "messages": the wire format the agent spoke
    model: str  # the model name the request gives
    headers: Mapping[str, str]  # the request's headers, names in lower case
    request: ChatCompletionRequest  # the request as the proxy runs it (translated to Chat Completions)


@dataclass(slots=True)
class SideCallRule:
    """Which calls of a session are side calls (see the module docstring); picklable, so that proxy worker
    processes get it (the predicate is imported where it is first used)."""

    models: tuple[str, ...] = ()
    header: str | None = None
    predicate: str | None = None
    _predicate: Callable[[SideCallRequest], Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.models = tuple(self.models)
        if self.header is not None:
            self.header = self.header.lower()

    def __getstate__(self) -> dict[str, Any]:
        return {"models": self.models, "header": self.header, "predicate": self.predicate}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.models, self.header, self.predicate = state["models"], state["header"], state["predicate"]
        self._predicate = None

    @property
    def active(self) -> bool:
        """Whether any rule is set (without one, every call is trainable and nothing is checked)."""
        return bool(self.models or self.header or self.predicate)

    def model_kind(self, model: str) -> str | None:
        """``model:<name>`` when ``model`` is one of the side-call model names, else None."""
        if any(model == pattern or fnmatch.fnmatchcase(model, pattern) for pattern in self.models):
            return safe_kind(f"model:{model}")
        return None

    def kind(
        self, api: str, model: str, headers: Mapping[str, str], request: ChatCompletionRequest
    ) -> str | None:
        """The side-call kind of a request, or None when it is trainable.

        Raises:
            ConfigError: ``predicate`` does not import as a callable.
            TypeError: the predicate returned something other than a string, a bool or None.
        """
        kind = self.model_kind(model)
        if kind is not None:
            return kind
        if self.header is not None:
            value = headers.get(self.header)
            if value is not None:
                return safe_kind(value.strip() or self.header)
        if self.predicate is not None:
            if self._predicate is None:
                self._predicate = import_object(self.predicate, key="agent.side_calls.predicate")
            verdict = self._predicate(SideCallRequest(api, model, headers, request))
            if verdict is None or verdict is False:
                return None
            if verdict is True:
                return "predicate"
            if not isinstance(verdict, str):
                raise TypeError(
                    f"agent.side_calls.predicate {self.predicate!r} returned {type(verdict).__name__}; "
                    "return the side call's kind (a string), True, or None/False for a trainable call"
                )
            return safe_kind(verdict)
        return None


def safe_kind(kind: str) -> str:
    """``kind`` as it is recorded and counted: at most 64 characters of letters, digits and ``_.:-``."""
    return _KIND_UNSAFE.sub("_", kind)[:_MAX_KIND_CHARS] or "side"
