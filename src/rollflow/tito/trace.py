"""``Trace``: one session's message tree with the exact tokens that were rendered and sampled.

Each node is one message and the token segment it added: for user, system and tool messages the rendered
tokens; for an assistant message the generation prompt followed by the sampled tokens, with their logprobs,
policy versions and (optionally) MoE routed-expert indices. A branch is a path from the root to a leaf.

The trace is an actor: ``prepare`` (render a request against the tree) and ``commit`` (record a sampled turn)
go through a mailbox processed in order by one task, so concurrent requests of a session never interleave
inside an operation and callers share no lock with it. An operation that finds the mailbox empty and no task
running it runs at once in its caller (the order is the same; the task and its passes through the loop are
saved), unless it is offloaded to a thread. Nodes are never removed or changed once committed,
so a request prepared before another one committed still commits correctly: ``commit`` reuses a child only
when its message and tokens both match, and otherwise forks a new branch.

Rendering (the ``prepare`` step): the recorded path whose messages are a prefix of the request and that ends
at a sampled assistant turn is extended with ``bridge_to_next_turn`` when the renderer accepts and the result
keeps every recorded token; otherwise the request is rendered fully, matched against the tree by message
and token, and wherever the tokens differ from what was recorded it starts a new branch. How each turn
was rendered, and why, is kept in ``Turn.render``.

Cost per turn: an agent's next request is usually its last request plus the reply and a tool result or user
message. The trace keeps a digest of the last committed request, so such a request is matched by one
encode and one digest of the request (in C) and a comparison of the reply, not by comparing every message
with the tree; and the bridge is handed the prompt from the previous sampled turn on, not the whole history.
What remains proportional to the history is reading the request once and building the prompt list the
engine takes. The tree itself is stored compactly (``rollflow.tito.store``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from rollflow.errors import EngineError, RoutedExpertsError, TraceSealedError
from rollflow.tito.renderer import TITORenderer, tools_key
from rollflow.tito.segments import align_routed_experts, common_prefix, expert_rows, segment_ends
from rollflow.tito.store import (
    Node,
    NodeList,
    NodeStore,
    RenderRecord,
    Turn,
    TurnLog,
    encode_message,
)

__all__ = [
    "Node",
    "PreparedTurn",
    "RenderRecord",
    "RoutedExpertsError",
    "Sampled",
    "Trace",
    "TraceSealedError",
    "TraceStats",
    "Turn",
]


@dataclass(frozen=True, slots=True)
class _RequestPrefix:
    """A request's messages as the next request of the session is checked against them: how many there
    were, and the digest of their JSON encoding up to (not including) the closing bracket."""

    num_messages: int
    encoded_len: int
    digest: bytes


@dataclass(slots=True)
class PreparedTurn:
    """A rendered request, ready to sample from and then to commit.

    ``prompt`` is the trace's own int32 copy of the prompt (one memcpy per turn); ``prompt_ids`` is the list
    an engine request takes, made on first use. ``parse_prompt_ids`` is the prompt from the previous sampled
    turn on: all a renderer's ``parse_response`` reads (the current turn's header and generation prompt).
    """

    prompt: array
    tools: list[dict[str, Any]] | None
    render: RenderRecord
    _base: int
    _new_messages: list[dict[str, Any]]
    _segment_ends: list[int]
    _tools_key: bytes
    _request: _RequestPrefix
    _parse_from: int = 0
    _prompt_ids: list[int] | None = None

    @property
    def prompt_ids(self) -> list[int]:
        if self._prompt_ids is None:
            self._prompt_ids = self.prompt.tolist()
        return self._prompt_ids

    @property
    def parse_prompt_ids(self) -> list[int]:
        return self.prompt[self._parse_from :].tolist()


@dataclass(slots=True)
class Sampled:
    """What the engine returned for a turn (possibly over several resubmissions)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str  # the engine's: stop, length, abort
    routed_experts: Any = None  # [prompt + completion (or one less), layers, topk] integers, or None
    kept_counts: list[int] | None = None  # per token, the sampler's kept count; None: nothing was cut


@dataclass
class TraceStats:
    turns: int = 0
    bridged: int = 0
    full_render: int = 0
    forked: int = 0
    replayed: int = 0
    errors: int = 0
    context_exceeded: int = 0
    # Requests whose history was matched by following the previous turn (no walk of the tree).
    followed: int = 0
    # Requests that asked for another temperature or top_p than the run's, sampled at the run's instead.
    sampling_overridden: int = 0
    # Streamed replies whose deltas differ from the recorded message (a parser re-read text already sent).
    streams_diverged: int = 0
    # Request fields the proxy does not know, ignored (``agent.strict_requests`` refuses them instead).
    unknown_fields: int = 0
    # Known request values the proxy cannot enforce, left aside (``tool_choice: "required"``).
    ignored_values: int = 0
    # Side calls (``rollflow.tito.side_calls``): recorded, never trained; by kind in ``Trace.side_calls``.
    side_calls: int = 0


_BRIDGE_REASON = "the history extends a recorded sampled turn"


class Trace:
    """The message tree of one session; an actor (see the module docstring).

    Args:
        renderer: the adapter that renders this session's requests.
        session_id: for messages and metrics.
    """

    def __init__(self, renderer: TITORenderer, session_id: str = ""):
        self.renderer = renderer
        self.session_id = session_id
        self._store = NodeStore()
        self.nodes = NodeList(self._store)
        self.root = Node(self._store, 0)
        self.turns = TurnLog(self._store)
        self.stats = TraceStats()
        # Turn failures inside the proxy (engine gone, bugs); set by the proxy.
        self.errors: list[str] = []
        # Set by whoever closes the session: the agent failed, or ran out of time.
        self.error: str | None = None
        self.timed_out = False
        self.sealed = False
        self._replays: dict[str, tuple[int, int]] = {}  # request key -> (first turn, number of turns)
        # Names of the ignored fields and values, with how often each was seen.
        self.ignored: dict[str, int] = {}
        # Side calls by kind, and the sampled node of each side-call reply with its kind (never trained).
        self.side_calls: dict[str, int] = {}
        self.side_nodes: dict[int, str] = {}
        # The last committed turn's node and its request: a request that repeats that request and adds the
        # reply is matched by one digest instead of a walk over the tree.
        self._cursor: tuple[int, _RequestPrefix] | None = None
        self._latest_sampled = 0  # the newest sampled node (a bridge anchors at the newest match)
        # Sampled nodes whose last routed-experts row is a stand-in: the engine never ran their last token.
        self._padded_routes: set[int] = set()
        self._mailbox: collections.deque[tuple[Callable[..., Any], tuple, asyncio.Future, bool]] = (
            collections.deque()
        )
        self._worker: asyncio.Task | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A sealed trace crosses processes (``rollflow.tito.workers``) without its renderer and actor state:
        the receiver sets ``renderer`` to its own."""
        if self._mailbox or self._worker is not None:
            raise RuntimeError(f"trace of session {self.session_id!r} has operations running; seal it first")
        state = self.__dict__.copy()
        for name in ("renderer", "_mailbox", "_worker", "_cursor"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.renderer = None  # type: ignore[assignment]
        self._cursor = None
        self._mailbox = collections.deque()
        self._worker = None

    # ------------------------------------------------------------------ actor plumbing

    def _call(self, fn: Callable[..., Any], *args: Any, offload: bool = False) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self._worker is None and not self._mailbox and not offload:
            # Nothing queued or running: run it now, exactly as the worker would next, without starting a
            # task and passing through the loop twice (two operations per turn, on every turn).
            try:
                future.set_result(fn(*args))
            except Exception as error:
                future.set_exception(error)
            return future
        self._mailbox.append((fn, args, future, offload))
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return future

    async def _drain(self) -> None:
        try:
            while self._mailbox:
                fn, args, future, offload = self._mailbox.popleft()
                if future.cancelled():  # the caller left (e.g. its client disconnected): skip its work
                    continue
                try:
                    # A large render runs in a worker thread so other sessions (and /health) are served
                    # meanwhile; the mailbox still runs one operation at a time.
                    result = await anyio.to_thread.run_sync(fn, *args) if offload else fn(*args)
                except Exception as error:
                    if not future.done():  # an offloaded caller may have left while it ran
                        future.set_exception(error)
                else:
                    if not future.done():
                        future.set_result(result)
                # Drop this operation's arguments and result before yielding: the worker must not keep a
                # request's prompt alive while other sessions run.
                fn = args = future = result = None
                await asyncio.sleep(0)  # let other sessions' work interleave between operations
        finally:
            self._worker = None

    # ------------------------------------------------------------------ public async API

    async def prepare(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        renderer: TITORenderer | None = None,
        offload: bool = False,
    ) -> PreparedTurn:
        """Render a request (normalized messages) against the tree; ``renderer``: a variant of the trace's
        (``TITORenderer.variant``) for this request; ``offload``: in a worker thread (for large requests;
        rendering only reads the tree, which changes only in ``commit``).

        Raises:
            TraceSealedError: the session is closed.
        """
        return await self._call(self._prepare, messages, tools, renderer or self.renderer, offload=offload)

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
            EngineError: ``sampled`` has not one logprob and one policy version per token.
        """
        return await self._call(
            self._commit, prepared, sampled, message, finish_reason, response_id, request_key
        )

    async def commit_choices(
        self,
        prepared: PreparedTurn,
        choices: list[tuple[Sampled, dict[str, Any], str, dict[str, Any] | None]],
        *,
        response_id: str,
        request_key: str | None = None,
        side_call: str | None = None,
    ) -> list[Turn]:
        """Record the replies sampled for one prepared request, in one operation so their turns are
        consecutive: each choice is ``(sampled, message, finish_reason, options)``, where ``options`` is
        what the request set for the turn (``chat_template_kwargs``, the ``stop_reason``), kept with it. The
        replies of one prompt become sibling branches; of a ``side_call`` (its kind), non-trainable ones.

        Raises:
            as ``commit``.
        """
        return await self._call(self._commit_choices, prepared, choices, response_id, request_key, side_call)

    async def seal(self) -> None:
        """Refuse further turns (queued operations still run first)."""
        await self._call(self._seal)

    def end(self, *, error: str | None, timed_out: bool) -> None:
        """Record how the session ended and seal the trace. At once, not through the mailbox: the session
        closes after its requests were drained (or cancelled), also when the close itself is cancelled, and
        operations still queued then fail as sealed."""
        self.error, self.timed_out = error, timed_out
        self._seal()

    def replay(self, request_key: str) -> list[Turn] | None:
        """The turns recorded for ``request_key`` (a retried request), if any."""
        recorded = self._replays.get(request_key)
        if recorded is None:
            return None
        self.stats.replayed += 1
        first, count = recorded
        return self.turns[first : first + count]

    def count_ignored(self, unknown_fields: list[str], ignored_values: list[str]) -> None:
        """Count a request's ignored fields and values (``DecodedRequest``) in ``stats`` and ``ignored``."""
        self.stats.unknown_fields += len(unknown_fields)
        self.stats.ignored_values += len(ignored_values)
        for name in (*unknown_fields, *ignored_values):
            self.ignored[name] = self.ignored.get(name, 0) + 1

    # ------------------------------------------------------------------ reading (after sealing, or any time)

    def leaves(self) -> list[Node]:
        """Branch ends in creation order."""
        first_child = self._store.first_child
        return [Node(self._store, i) for i in range(1, len(first_child)) if first_child[i] < 0]

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
            "ignored": dict(self.ignored),
            "side_calls": dict(self.side_calls),
            "nodes": [
                {
                    "id": node.id,
                    "parent": self._store.parent[node.id],
                    "message": node.message,
                    "token_ids": node.token_ids.tolist(),
                    "num_prompt": node.num_prompt,
                    "logprobs": node.logprobs.tolist() if node.logprobs is not None else None,
                    "policy_versions": node.policy_versions.tolist()
                    if node.policy_versions is not None
                    else None,
                    "finish_reason": node.finish_reason,
                    # Only where top-k/top-p cut a sampled token: the sampler's kept counts.
                    **({"kept_counts": node.kept_counts.tolist()} if node.kept_counts is not None else {}),
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
                    "options": turn.options,
                }
                for turn in self.turns
            ],
        }

    # ------------------------------------------------------------------ operations (run by the worker)

    def _seal(self) -> None:
        self.sealed = True

    def _check_open(self) -> None:
        if self.sealed:
            raise TraceSealedError("this session is closed")  # an agent may read it: no id

    def _prepare(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, renderer: TITORenderer
    ) -> PreparedTurn:
        self._check_open()
        key = tools_key(tools, renderer.tag)
        last_assistant = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), -1
        )
        anchor, request = self._follow(messages, last_assistant)
        if last_assistant < 0:
            reason = "no assistant turn in the history"
        else:
            if anchor is None:
                anchor = self._find_anchor(messages[: last_assistant + 1])
            if anchor is None:
                reason = "no recorded sampled turn matches the history"
            elif (recorded_key := Node(self._store, anchor).tools_key) != key:
                reason = (
                    "tools changed since the recorded turn"
                    if recorded_key is None or recorded_key[:16] != key[:16]
                    else "chat_template_kwargs changed since the recorded turn"
                )
            else:
                prepared = self._try_bridge(
                    anchor, messages[last_assistant + 1 :], tools, key, request, renderer
                )
                if isinstance(prepared, PreparedTurn):
                    return prepared
                reason = prepared
        return self._full_render(messages, tools, key, reason, request, renderer)

    def _follow(
        self, messages: list[dict[str, Any]], last_assistant: int
    ) -> tuple[int | None, _RequestPrefix]:
        """The anchor when the request is the last committed request plus that turn's reply (and what
        follows it), else None; and this request's prefix record. One encode and one digest of the
        request, in C, instead of a walk comparing each message of the history with the tree."""
        encoded = memoryview(encode_message(messages))  # type: ignore[arg-type]
        digest = hashlib.sha256()
        done = 0
        anchor = None
        if self._cursor is not None:
            node, previous = self._cursor
            if (
                node == self._latest_sampled  # a newer match would be the anchor otherwise
                and last_assistant == previous.num_messages > 0
                and len(encoded) > previous.encoded_len
                and encoded[previous.encoded_len] == ord(",")  # the previous messages end exactly here
            ):
                done = previous.encoded_len
                digest.update(encoded[:done])
                reply = messages[last_assistant]
                if digest.copy().digest() == previous.digest and self._store.matches(
                    node, reply, encode_message(reply)
                ):
                    anchor = node
                    self.stats.followed += 1
        digest.update(encoded[done:-1])
        return anchor, _RequestPrefix(len(messages), len(encoded) - 1, digest.digest())

    def _find_anchor(self, history: list[dict[str, Any]]) -> int | None:
        """The latest sampled assistant node whose path's messages equal ``history``."""
        store = self._store
        frontier = [0]
        for message in history:
            encoded = encode_message(message)
            frontier = [
                child
                for node in frontier
                for child in store.children(node)
                if store.matches(child, message, encoded)
            ]
            if not frontier:
                return None
        return max((node for node in frontier if store.sampled(node)), default=None)

    def _try_bridge(
        self,
        anchor: int,
        new_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        key: bytes,
        request: _RequestPrefix,
        renderer: TITORenderer,
    ) -> PreparedTurn | str:
        store = self._store
        recorded = store.path_tokens(anchor)
        split = store.start[anchor] + store.num_prompt[anchor]
        # The renderer sees the prompt from the previous sampled turn on (the whole prompt when there is
        # none): it reads only the turn boundary and the generation prompt before the sampled tokens, and
        # concatenating the whole history on every turn would make each turn cost more than the last.
        earlier = store.parent[anchor]
        while earlier > 0 and not store.sampled(earlier):
            earlier = store.parent[earlier]
        context = store.start[earlier] if earlier > 0 else 0
        prompt_tail, completion = recorded[context:split].tolist(), recorded[split:].tolist()
        rendered = renderer.bridge(prompt_tail, completion, new_messages, tools)
        if rendered is None:
            return "renderer declined to bridge (it cannot prove the bridge equals a full render)"
        kept = len(prompt_tail) + len(completion)
        if rendered.token_ids[:kept] != prompt_tail + completion:
            return "bridge changed recorded tokens"
        ends = segment_ends(rendered.message_indices, kept, len(new_messages), 0)
        ends = [context + end for end in ends]
        record = RenderRecord("bridge", "extended", _BRIDGE_REASON)
        # The prompt: the recorded tokens, then what the new messages added.
        recorded.extend(rendered.token_ids[kept:])
        return PreparedTurn(recorded, tools, record, anchor, new_messages, ends, key, request, context)

    def _full_render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        key: bytes,
        reason: str,
        request: _RequestPrefix,
        renderer: TITORenderer,
    ) -> PreparedTurn:
        store = self._store
        rendered = renderer.render(messages, tools)
        prompt = array("i", rendered.token_ids)
        node, depth = 0, 0
        fork_position = None
        while depth < len(messages):
            message = messages[depth]
            encoded = encode_message(message)
            same_message = [child for child in store.children(node) if store.matches(child, message, encoded)]
            start = store.end(node)
            child = next(
                (
                    c
                    for c in reversed(same_message)
                    if prompt[start : start + store.num_tokens(c)] == store.token_ids(c)
                ),
                None,
            )
            if child is None:
                if same_message:  # recorded under the same message, but with other tokens
                    fork_position = start + common_prefix(prompt[start:], store.token_ids(same_message[-1]))
                break
            node, depth = child, depth + 1
        start = store.end(node)
        children = list(store.children(node))
        if fork_position is None and depth > 0 and children:  # the history continues differently here
            fork_position = start + common_prefix(prompt[start:], store.token_ids(children[-1]))
        if fork_position is not None:
            record = RenderRecord("full", "forked", reason, fork_position)
        elif depth > 0:
            record = RenderRecord("full", "same_tokens", reason)
        else:
            record = RenderRecord("full", "new", reason)
        ends = segment_ends(rendered.message_indices, start, len(messages) - depth, depth)
        return PreparedTurn(prompt, tools, record, node, messages[depth:], ends, key, request)

    def _commit(
        self,
        prepared: PreparedTurn,
        sampled: Sampled,
        message: dict[str, Any],
        finish_reason: str,
        response_id: str,
        request_key: str | None,
        options: dict[str, Any] | None = None,
        *,
        replay_count: int = 1,
        side_call: str | None = None,
    ) -> Turn:
        self._check_open()
        if not len(sampled.token_ids) == len(sampled.logprobs) == len(sampled.policy_versions) or (
            sampled.kept_counts is not None and len(sampled.kept_counts) != len(sampled.token_ids)
        ):
            # The store keeps logprobs and versions side by side: a ragged output would shift every later node.
            raise EngineError(
                f"sampled output is ragged: {len(sampled.token_ids)} tokens, {len(sampled.logprobs)} logprobs, "
                f"{len(sampled.policy_versions)} policy versions"
            )
        store = self._store
        prompt = prepared.prompt
        total = len(prompt) + len(sampled.token_ids)
        experts = align_routed_experts(sampled.routed_experts, total)
        if experts is not None and self._padded_routes:
            self._repair_routes(prepared._base, experts)
        node = prepared._base
        for new_message, end in zip(prepared._new_messages, prepared._segment_ends, strict=True):
            start = store.end(node)
            node = self._child(
                node, new_message, prompt[start:end], end - start, expert_rows(experts, start, end)
            )
        start = store.end(node)
        node = self._child(
            node,
            message,
            prompt[start:] + array("i", sampled.token_ids),
            len(prompt) - start,
            expert_rows(experts, start, total),
            sampled=sampled,
            tools_key=prepared._tools_key,
            side_call=side_call,
        )
        if side_call is not None:
            self.side_nodes[node] = side_call
            self.side_calls[side_call] = self.side_calls.get(side_call, 0) + 1
            self.stats.side_calls += 1
        if experts is not None and len(sampled.routed_experts) == total - 1:
            self._padded_routes.add(node)
        self._latest_sampled = max(self._latest_sampled, node)
        self._cursor = (node, prepared._request)
        turn = self.turns.append(
            node,
            response_id,
            int(time.time()),
            finish_reason,
            len(prompt),
            prepared.render,
            request_key,
            options,
        )
        self.stats.turns += 1
        if prepared.render.method == "bridge":
            self.stats.bridged += 1
        else:
            self.stats.full_render += 1
            self.stats.forked += prepared.render.outcome == "forked"
        if request_key is not None:
            self._replays[request_key] = (turn.index, replay_count)
        return turn

    def _commit_choices(
        self,
        prepared: PreparedTurn,
        choices: list[tuple[Sampled, dict[str, Any], str, dict[str, Any] | None]],
        response_id: str,
        request_key: str | None,
        side_call: str | None = None,
    ) -> list[Turn]:
        turns = []
        for index, (sampled, message, finish_reason, options) in enumerate(choices):
            key = request_key if index == 0 else None  # the first turn's index and the count name them all
            turns.append(
                self._commit(
                    prepared,
                    sampled,
                    message,
                    finish_reason,
                    response_id,
                    key,
                    options,
                    replay_count=len(choices),
                    side_call=side_call,
                )
            )
        return turns

    def _repair_routes(self, node: int, experts: Any) -> None:
        """Replace the stand-in last rows of padded nodes on the path to ``node`` with the routes this turn's
        forward computed for those tokens (they are in its prompt), so mid-sequence rows are all real."""
        store = self._store
        while node > 0:
            if node in self._padded_routes:
                self._padded_routes.discard(node)
                if (rows := store.routed_experts.get(node)) is not None:
                    rows[-1] = experts[store.end(node) - 1]
            node = store.parent[node]

    def _child(
        self,
        parent: int,
        message: dict[str, Any],
        token_ids: array,
        num_prompt: int,
        experts: Any,
        *,
        sampled: Sampled | None = None,
        tools_key: bytes | None = None,
        side_call: str | None = None,
    ) -> int:
        """The child of ``parent`` with this message and these tokens: an existing one, else a new one (a
        side call's reply never shares a node with a trainable reply)."""
        store = self._store
        encoded = encode_message(message)
        for child in store.children(parent):
            if (
                store.num_tokens(child) == len(token_ids)
                and store.num_prompt[child] == num_prompt
                and store.sampled(child) == (sampled is not None)
                and self.side_nodes.get(child) == side_call
                and store.same_message(child, message, encoded)
                and store.token_ids(child) == token_ids
            ):
                return child
        return store.add(
            parent,
            message,
            encoded,
            token_ids,
            num_prompt,
            logprobs=sampled.logprobs if sampled is not None else None,
            policy_versions=sampled.policy_versions if sampled is not None else None,
            routed_experts=experts,
            finish_reason=sampled.finish_reason if sampled is not None else None,
            tools_key=tools_key,
            kept_counts=sampled.kept_counts if sampled is not None else None,
        )
