"""``Trace``: one session's message tree with the exact tokens that were rendered and sampled.

Each node is one message and the token segment it added: for user, system and tool messages the rendered
tokens; for an assistant message the generation prompt followed by the sampled tokens, with their logprobs,
policy versions and (optionally) MoE routed-expert indices. A branch is a path from the root to a leaf.

The trace is an actor: ``prepare`` (render a request against the tree) and ``commit`` (record a sampled turn)
go through a mailbox processed in order by one task, so concurrent requests of a session never interleave
inside an operation and callers share no lock with it. Nodes are never removed or changed once committed,
so a request prepared before another one committed still commits correctly: ``commit`` reuses a child only
when its message and tokens both match, and otherwise forks a new branch.

Rendering (the ``prepare`` step): the recorded path whose messages are a prefix of the request and that ends
at a sampled assistant turn is extended with ``bridge_to_next_turn`` when the renderer accepts and the result
keeps every recorded token; otherwise the request is rendered fully, matched against the tree by message
and token, and wherever the tokens differ from what was recorded it starts a new branch. How each turn
was rendered, and why, is kept in ``Turn.render``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rollflow.errors import RollflowError
from rollflow.tito.renderer import TITORenderer, tools_key


class TraceSealedError(RollflowError):
    """The session was closed: its trace takes no more turns."""


class RoutedExpertsError(RollflowError):
    """Routed-expert indices of a generation do not have the shape ``[tokens, layers, topk]`` of integers."""


def _strip_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    if "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}


class Node:
    """One message of the tree and the tokens it added (see the module docstring)."""

    __slots__ = (
        "children",
        "finish_reason",
        "id",
        "logprobs",
        "match_message",
        "message",
        "num_prompt",
        "parent",
        "policy_versions",
        "routed_experts",
        "start",
        "token_ids",
        "tools_key",
    )

    def __init__(
        self,
        id: int,
        parent: Node | None,
        message: dict[str, Any] | None,
        token_ids: array,
        num_prompt: int,
        logprobs: array | None = None,
        policy_versions: array | None = None,
        routed_experts: Any = None,
        finish_reason: str | None = None,
        tools_key: bytes | None = None,
    ):
        self.id = id
        self.parent = parent
        self.message = message
        # The message as a request must send it back to match (reasoning is optional there).
        self.match_message = _strip_reasoning(message) if message is not None else None
        self.token_ids = token_ids
        # Leading tokens that were rendered, not sampled; the rest (if any) were sampled.
        self.num_prompt = num_prompt
        self.logprobs = logprobs
        self.policy_versions = policy_versions
        self.routed_experts = routed_experts  # ndarray [len(token_ids), layers, topk] or None
        self.finish_reason = finish_reason
        # Sampled nodes: the tools the turn was rendered with; a bridge from it needs the same tools.
        self.tools_key = tools_key
        self.start = parent.start + len(parent.token_ids) if parent is not None else 0
        self.children: list[Node] = []

    @property
    def sampled(self) -> bool:
        """Whether this node holds tokens the policy sampled (an assistant turn generated here)."""
        return self.logprobs is not None

    @property
    def sampled_mask(self) -> list[bool]:
        n_sampled = len(self.token_ids) - self.num_prompt
        return [False] * self.num_prompt + [True] * n_sampled

    def path(self) -> list[Node]:
        """Nodes from the first message down to this one (the root excluded)."""
        nodes = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def prefix_ids(self) -> array:
        """All tokens from the start of the conversation to the end of this node."""
        out = array("i")
        for node in self.path():
            out.extend(node.token_ids)
        return out


@dataclass(frozen=True, slots=True)
class RenderRecord:
    """How one request's prompt was built.

    ``method``: ``bridge`` (recorded tokens extended by the renderer) or ``full`` (the history rendered).
    ``outcome``: ``extended`` (bridged), ``same_tokens`` (full render equal to the recorded path, which it
    extends), ``forked`` (the render differs from, or continues differently than, what was recorded: a new
    branch), ``new`` (no recorded message matched).
    ``fork_position``: for ``forked``, the first token position where the render differs from the recorded
    continuation.
    """

    method: Literal["bridge", "full"]
    outcome: Literal["extended", "same_tokens", "forked", "new"]
    reason: str
    fork_position: int | None = None


@dataclass(slots=True)
class PreparedTurn:
    """A rendered request, ready to sample from and then to commit."""

    prompt_ids: list[int]
    tools: list[dict[str, Any]] | None
    render: RenderRecord
    _base: Node
    _new_messages: list[dict[str, Any]]
    _segment_ends: list[int]
    _tools_key: bytes


@dataclass(slots=True)
class Sampled:
    """What the engine returned for a turn (possibly over several resubmissions)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str  # the engine's: stop, length, abort
    routed_experts: Any = None  # [prompt + completion (or one less), layers, topk] integers, or None


@dataclass(slots=True)
class Turn:
    """One answered model call, as recorded (replayed verbatim to a retried request)."""

    index: int
    response_id: str
    created: int
    node: Node
    message: dict[str, Any]
    finish_reason: str  # the API's: stop, length, tool_calls
    prompt_len: int
    render: RenderRecord
    request_key: str | None = None

    @property
    def completion_ids(self) -> list[int]:
        return self.node.token_ids[self.node.num_prompt :].tolist()

    @property
    def logprobs(self) -> list[float]:
        return self.node.logprobs.tolist()


@dataclass
class TraceStats:
    turns: int = 0
    bridged: int = 0
    full_render: int = 0
    forked: int = 0
    replayed: int = 0
    errors: int = 0
    context_exceeded: int = 0


class Trace:
    """The message tree of one session; an actor (see the module docstring).

    Args:
        renderer: the adapter that renders this session's requests.
        session_id: for messages and metrics.
    """

    def __init__(self, renderer: TITORenderer, session_id: str = ""):
        self.renderer = renderer
        self.session_id = session_id
        self.root = Node(0, None, None, array("i"), 0)
        self.nodes: list[Node] = [self.root]
        self.turns: list[Turn] = []
        self.stats = TraceStats()
        # Turn failures inside the proxy (engine gone, bugs); set by the proxy.
        self.errors: list[str] = []
        # Set by whoever closes the session: the agent failed, or ran out of time.
        self.error: str | None = None
        self.timed_out = False
        self.sealed = False
        self._replays: dict[str, Turn] = {}
        self._ids = itertools.count(1)
        self._mailbox: collections.deque[tuple[Callable[..., Any], tuple, asyncio.Future]] = (
            collections.deque()
        )
        self._worker: asyncio.Task | None = None

    # ------------------------------------------------------------------ actor plumbing

    def _call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._mailbox.append((fn, args, future))
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return future

    async def _drain(self) -> None:
        try:
            while self._mailbox:
                fn, args, future = self._mailbox.popleft()
                if future.cancelled():  # the caller left (e.g. its client disconnected): skip its work
                    continue
                try:
                    result = fn(*args)
                except Exception as error:
                    future.set_exception(error)
                else:
                    future.set_result(result)
                await asyncio.sleep(0)  # let other sessions' work interleave between operations
        finally:
            self._worker = None

    # ------------------------------------------------------------------ public async API

    async def prepare(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> PreparedTurn:
        """Render a request (normalized messages) against the tree.

        Raises:
            TraceSealedError: the session is closed.
        """
        return await self._call(self._prepare, messages, tools)

    async def commit(
        self,
        prepared: PreparedTurn,
        sampled: Sampled,
        message: dict[str, Any],
        *,
        finish_reason: str,
        response_id: str,
        request_key: str | None = None,
    ) -> Turn:
        """Record a sampled turn: reuse matching nodes, fork where tokens differ, add the assistant node.

        Raises:
            TraceSealedError: the session is closed.
            RoutedExpertsError: ``sampled.routed_experts`` has the wrong shape or dtype.
        """
        return await self._call(
            self._commit, prepared, sampled, message, finish_reason, response_id, request_key
        )

    async def seal(self) -> None:
        """Refuse further turns (queued operations still run first)."""
        await self._call(self._seal)

    def replay(self, request_key: str) -> Turn | None:
        """The turn recorded for ``request_key`` (a retried request), if any."""
        turn = self._replays.get(request_key)
        if turn is not None:
            self.stats.replayed += 1
        return turn

    # ------------------------------------------------------------------ reading (after sealing, or any time)

    def leaves(self) -> list[Node]:
        """Branch ends in creation order."""
        return [node for node in self.nodes[1:] if not node.children]

    def branches(self) -> list[list[Node]]:
        """Every root-to-leaf path (the root excluded), in the order their leaves were created."""
        return [leaf.path() for leaf in self.leaves()]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON export (admin endpoint, debugging)."""
        return {
            "session_id": self.session_id,
            "sealed": self.sealed,
            "error": self.error,
            "timed_out": self.timed_out,
            "errors": list(self.errors),
            "stats": vars(self.stats) | {"branches": len(self.leaves()), "nodes": len(self.nodes) - 1},
            "nodes": [
                {
                    "id": node.id,
                    "parent": node.parent.id if node.parent is not None else None,
                    "message": node.message,
                    "token_ids": node.token_ids.tolist(),
                    "num_prompt": node.num_prompt,
                    "logprobs": node.logprobs.tolist() if node.logprobs is not None else None,
                    "policy_versions": node.policy_versions.tolist()
                    if node.policy_versions is not None
                    else None,
                    "finish_reason": node.finish_reason,
                }
                for node in self.nodes[1:]
            ],
            "turns": [
                {
                    "index": turn.index,
                    "node": turn.node.id,
                    "response_id": turn.response_id,
                    "finish_reason": turn.finish_reason,
                    "prompt_len": turn.prompt_len,
                    "render": {
                        "method": turn.render.method,
                        "outcome": turn.render.outcome,
                        "reason": turn.render.reason,
                        "fork_position": turn.render.fork_position,
                    },
                }
                for turn in self.turns
            ],
        }

    # ------------------------------------------------------------------ operations (run by the worker)

    def _seal(self) -> None:
        self.sealed = True

    def _check_open(self) -> None:
        if self.sealed:
            raise TraceSealedError(f"session {self.session_id!r} is closed")

    def _prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PreparedTurn:
        self._check_open()
        key = tools_key(tools)
        match_messages = [_strip_reasoning(m) for m in messages]
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last_assistant < 0:
            reason = "no assistant turn in the history"
        else:
            anchor = self._find_anchor(messages[: last_assistant + 1], match_messages)
            if anchor is None:
                reason = "no recorded sampled turn matches the history"
            elif anchor.tools_key != key:
                reason = "tools changed since the recorded turn"
            else:
                prepared = self._try_bridge(anchor, messages[last_assistant + 1 :], tools, key)
                if isinstance(prepared, PreparedTurn):
                    return prepared
                reason = prepared
        return self._full_render(messages, match_messages, tools, key, reason)

    def _find_anchor(
        self, history: list[dict[str, Any]], match_messages: list[dict[str, Any]]
    ) -> Node | None:
        """The latest sampled assistant node whose path's messages equal ``history``."""
        frontier = [self.root]
        # match_messages covers the whole request; history ends at its last assistant message.
        for message, match in zip(history, match_messages, strict=False):
            exact = "reasoning_content" in message
            # A linear conversation (the common case) needs no frontier lists.
            if len(frontier) == 1 and len(frontier[0].children) == 1:
                child = frontier[0].children[0]
                if not (child.message == message if exact else child.match_message == match):
                    return None
                frontier[0] = child
                continue
            frontier = [
                child
                for node in frontier
                for child in node.children
                if (child.message == message if exact else child.match_message == match)
            ]
            if not frontier:
                return None
        sampled = [node for node in frontier if node.sampled]
        return max(sampled, key=lambda node: node.id) if sampled else None

    def _try_bridge(
        self, anchor: Node, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, key: bytes
    ) -> PreparedTurn | str:
        previous = anchor.prefix_ids().tolist()
        split = anchor.start + anchor.num_prompt
        rendered = self.renderer.bridge(previous[:split], previous[split:], new_messages, tools)
        if rendered is None:
            return "renderer declined to bridge (it cannot prove the bridge equals a full render)"
        if rendered.token_ids[: len(previous)] != previous:
            return "bridge changed recorded tokens"
        ends = _segment_ends(rendered.message_indices, len(previous), len(new_messages), 0)
        record = RenderRecord("bridge", "extended", f"extends turn at node {anchor.id}")
        return PreparedTurn(rendered.token_ids, tools, record, anchor, new_messages, ends, key)

    def _full_render(
        self,
        messages: list[dict[str, Any]],
        match_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        key: bytes,
        reason: str,
    ) -> PreparedTurn:
        rendered = self.renderer.render(messages, tools)
        prompt = array("i", rendered.token_ids)
        node, depth = self.root, 0
        fork_position = None
        while depth < len(messages):
            exact = "reasoning_content" in messages[depth]
            same_message = [
                child
                for child in node.children
                if (
                    child.message == messages[depth]
                    if exact
                    else child.match_message == match_messages[depth]
                )
            ]
            start = node.start + len(node.token_ids)
            child = next(
                (
                    c
                    for c in reversed(same_message)
                    if prompt[start : start + len(c.token_ids)] == c.token_ids
                ),
                None,
            )
            if child is None:
                if same_message:  # recorded under the same message, but with other tokens
                    fork_position = start + _common_prefix(prompt[start:], same_message[-1].token_ids)
                break
            node, depth = child, depth + 1
        start = node.start + len(node.token_ids)
        if fork_position is None and depth > 0 and node.children:  # the history continues differently here
            fork_position = start + _common_prefix(prompt[start:], node.children[-1].token_ids)
        if fork_position is not None:
            record = RenderRecord("full", "forked", reason, fork_position)
        elif depth > 0:
            record = RenderRecord("full", "same_tokens", reason)
        else:
            record = RenderRecord("full", "new", reason)
        ends = _segment_ends(rendered.message_indices, start, len(messages) - depth, depth)
        return PreparedTurn(rendered.token_ids, tools, record, node, messages[depth:], ends, key)

    def _commit(
        self,
        prepared: PreparedTurn,
        sampled: Sampled,
        message: dict[str, Any],
        finish_reason: str,
        response_id: str,
        request_key: str | None,
    ) -> Turn:
        self._check_open()
        prompt = prepared.prompt_ids
        total = len(prompt) + len(sampled.token_ids)
        experts = _check_routed_experts(sampled.routed_experts, total)
        node = prepared._base
        for new_message, end in zip(prepared._new_messages, prepared._segment_ends, strict=True):
            start = node.start + len(node.token_ids)
            segment = array("i", prompt[start:end])
            node = self._child(node, new_message, segment, len(segment), experts=_rows(experts, start, end))
        start = node.start + len(node.token_ids)
        segment = array("i", prompt[start:])
        num_prompt = len(segment)
        segment.extend(sampled.token_ids)
        node = self._child(
            node,
            message,
            segment,
            num_prompt,
            logprobs=array("d", sampled.logprobs),
            policy_versions=array("i", sampled.policy_versions),
            experts=_rows(experts, start, total),
            finish_reason=sampled.finish_reason,
            tools_key=prepared._tools_key,
        )
        turn = Turn(
            index=len(self.turns),
            response_id=response_id,
            created=int(time.time()),
            node=node,
            message=message,
            finish_reason=finish_reason,
            prompt_len=len(prompt),
            render=prepared.render,
            request_key=request_key,
        )
        self.turns.append(turn)
        self.stats.turns += 1
        if prepared.render.method == "bridge":
            self.stats.bridged += 1
        else:
            self.stats.full_render += 1
            self.stats.forked += prepared.render.outcome == "forked"
        if request_key is not None:
            self._replays[request_key] = turn
        return turn

    def _child(
        self,
        parent: Node,
        message: dict[str, Any],
        token_ids: array,
        num_prompt: int,
        *,
        logprobs: array | None = None,
        policy_versions: array | None = None,
        experts: Any = None,
        finish_reason: str | None = None,
        tools_key: bytes | None = None,
    ) -> Node:
        for child in parent.children:
            if (
                child.message == message
                and child.num_prompt == num_prompt
                and child.sampled == (logprobs is not None)
                and child.token_ids == token_ids
            ):
                return child
        node = Node(
            next(self._ids),
            parent,
            message,
            token_ids,
            num_prompt,
            logprobs,
            policy_versions,
            experts,
            finish_reason,
            tools_key,
        )
        parent.children.append(node)
        self.nodes.append(node)
        return node


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _segment_ends(indices: list[int], start: int, num_messages: int, first_index: int) -> list[int]:
    """End position of each new message's token segment: just after its last attributed token, never
    before ``start`` or the previous end. Scaffolding after the last message (the generation prompt) then
    belongs to the assistant node that follows."""
    ends = [start] * num_messages
    for position in range(start, len(indices)):
        index = indices[position] - first_index
        if 0 <= index < num_messages:
            ends[index] = position + 1
    for i in range(1, num_messages):
        ends[i] = max(ends[i], ends[i - 1])
    return ends


def _check_routed_experts(experts: Any, total: int) -> Any:
    """Validate ``[tokens, layers, topk]`` integer indices; engines omit the last position, which is padded
    with a copy of the one before (any valid expert ids do: no loss is computed at that position)."""
    if experts is None:
        return None
    import numpy as np

    experts = np.asarray(experts)
    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
        raise RoutedExpertsError(
            f"routed_experts must be an integer array [tokens, layers, topk], got dtype {experts.dtype} "
            f"and shape {experts.shape}"
        )
    if experts.shape[0] == total - 1 and total > 1:
        experts = np.concatenate([experts, experts[-1:]], axis=0)
    if experts.shape[0] != total:
        raise RoutedExpertsError(
            f"routed_experts has {experts.shape[0]} rows for {total} prompt + completion tokens "
            f"(expected {total} or {total - 1})"
        )
    return experts.astype(np.int32, copy=False)


def _rows(experts: Any, start: int, end: int) -> Any:
    return None if experts is None else experts[start:end].copy()
