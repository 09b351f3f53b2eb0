"""Compact storage of a trace: the message tree's nodes and the log of answered turns, kept in columns.

A trace of a long agent session holds tens of thousands of tokens in a few hundred nodes, and a proxy holds
thousands of traces, so per-node Python objects (a node object, a list of children, three arrays, a message
dict) would cost more than the tokens themselves. Here every node is a row of int32 columns: its token
segment lives in one int32 arena shared by the tree, the logprobs (float64) and policy versions (int32) of its
sampled tokens in two more, and its message is msgspec-encoded JSON in a byte arena, decoded when read. A
``Node`` is a small view (store, id) made on access; two views of one node compare equal. Turns are stored the
same way and read through ``Turn`` views. Nothing is ever changed or removed once added.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

NO_NODE = -1


def encode_message(message: dict[str, Any]) -> bytes:
    """A message as the bytes the store keeps (JSON, keys in insertion order)."""
    return _encode(message)


def strip_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message without ``reasoning_content`` (clients commonly drop it when they send a reply back)."""
    if "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}


class _Interned:
    """Small codes for values repeated across rows (finish reasons, tool sets, render reasons)."""

    __slots__ = ("_codes", "values")

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._codes: dict[Any, int] = {}

    def code(self, value: Any) -> int:
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self.values)
            self.values.append(value)
        return code


class NodeStore:
    """The message tree: node 0 is the root (no message, no tokens); ids are creation order."""

    def __init__(self) -> None:
        # Segments and messages are appended in id order, so a node's extent is [end[id - 1], end[id]).
        self.tokens = array("i")
        self.token_end = array("i", [0])
        self.message_bytes = array("B")
        self.message_end = array("i", [0])
        # Sampled tokens of sampled nodes, appended in id order; sample_start is -1 for other nodes.
        self.logprobs = array("d")
        self.policy_versions = array("i")
        self.sample_start = array("i", [NO_NODE])
        self.parent = array("i", [NO_NODE])
        self.first_child = array("i", [NO_NODE])
        self.next_sibling = array("i", [NO_NODE])
        # Position of the node's first token in its conversation, and how many leading tokens were rendered.
        self.start = array("i", [0])
        self.num_prompt = array("i", [0])
        # The earliest ancestor from which the path's segments lie back to back in ``tokens`` (a linear
        # conversation is one run), so a path's tokens are a few slices, not one per node.
        self.run_head = array("i", [0])
        self.has_reasoning = array("b", [0])
        self.finish = array("b", [-1])
        self.tools = array("i", [-1])
        self.finish_names = _Interned()
        self.tools_keys = _Interned()
        self.routed_experts: dict[int, Any] = {}  # sparse: only engines that report routes fill it
        # Sparse: sampled nodes of which a token was cut by top-k/top-p; the sampler's kept counts.
        self.kept_counts: dict[int, array] = {}

    def __len__(self) -> int:
        return len(self.parent)

    def add(
        self,
        parent: int,
        message: dict[str, Any],
        encoded: bytes,
        token_ids: Sequence[int],
        num_prompt: int,
        *,
        logprobs: Sequence[float] | None = None,
        policy_versions: Sequence[int] | None = None,
        routed_experts: Any = None,
        finish_reason: str | None = None,
        tools_key: bytes | None = None,
        kept_counts: Sequence[int] | None = None,
    ) -> int:
        """Append a child of ``parent`` (``encoded`` is ``encode_message(message)``) and return its id."""
        node = len(self.parent)
        token_start = self.token_end[-1]
        self.tokens.extend(token_ids)
        self.token_end.append(len(self.tokens))
        self.message_bytes.frombytes(encoded)
        self.message_end.append(len(self.message_bytes))
        if logprobs is not None:
            self.sample_start.append(len(self.logprobs))
            self.logprobs.extend(logprobs)
            self.policy_versions.extend(policy_versions if policy_versions is not None else ())
        else:
            self.sample_start.append(NO_NODE)
        self.parent.append(parent)
        self.first_child.append(NO_NODE)
        self.next_sibling.append(NO_NODE)
        self._link(parent, node)
        self.start.append(self.start[parent] + self.token_end[parent] - self._token_begin(parent))
        self.num_prompt.append(num_prompt)
        contiguous = parent != 0 and self.token_end[parent] == token_start
        self.run_head.append(self.run_head[parent] if contiguous else node)
        self.has_reasoning.append("reasoning_content" in message)
        self.finish.append(self.finish_names.code(finish_reason) if finish_reason is not None else -1)
        self.tools.append(self.tools_keys.code(tools_key) if tools_key is not None else -1)
        if routed_experts is not None:
            self.routed_experts[node] = routed_experts
        if kept_counts is not None and any(kept_counts):
            self.kept_counts[node] = array("i", kept_counts)
        return node

    def _link(self, parent: int, node: int) -> None:
        child = self.first_child[parent]
        if child == NO_NODE:
            self.first_child[parent] = node
            return
        while self.next_sibling[child] != NO_NODE:
            child = self.next_sibling[child]
        self.next_sibling[child] = node

    # ------------------------------------------------------------------ reading one node

    def _token_begin(self, node: int) -> int:
        return self.token_end[node - 1] if node > 0 else 0

    def num_tokens(self, node: int) -> int:
        return self.token_end[node] - self._token_begin(node)

    def end(self, node: int) -> int:
        """Conversation position just after the node's last token."""
        return self.start[node] + self.num_tokens(node)

    def token_ids(self, node: int) -> array:
        return self.tokens[self._token_begin(node) : self.token_end[node]]

    def sampled(self, node: int) -> bool:
        return self.sample_start[node] != NO_NODE

    def encoded_message(self, node: int) -> bytes:
        begin = self.message_end[node - 1] if node > 0 else 0
        return self.message_bytes[begin : self.message_end[node]].tobytes()

    def message(self, node: int) -> dict[str, Any] | None:
        return None if node == 0 else _decode(self.encoded_message(node))

    def same_message(self, node: int, message: dict[str, Any], encoded: bytes) -> bool:
        """Whether ``message`` (``encoded`` by ``encode_message``) equals the node's message as a dict."""
        return self.encoded_message(node) == encoded or self.message(node) == message

    def matches(self, node: int, message: dict[str, Any], encoded: bytes) -> bool:
        """Whether a request ``message`` (``encoded`` by ``encode_message``) stands for this node's message:
        equal, or equal but for the recorded reasoning, which the request left out."""
        if self.same_message(node, message, encoded):
            return True
        if "reasoning_content" in message or not self.has_reasoning[node]:
            return False
        return strip_reasoning(self.message(node)) == message  # type: ignore[arg-type]

    def children(self, node: int) -> Iterator[int]:
        child = self.first_child[node]
        while child != NO_NODE:
            yield child
            child = self.next_sibling[child]

    def path_tokens(self, node: int) -> array:
        """All tokens from the start of the conversation to the end of ``node``."""
        runs = []
        while node > 0:
            head = self.run_head[node]
            runs.append(self.tokens[self._token_begin(head) : self.token_end[node]])
            node = self.parent[head]
        if len(runs) == 1:
            return runs[0]
        out = array("i")
        for run in reversed(runs):
            out.extend(run)
        return out


class Node:
    """One message of the tree and the tokens it added: a view into a ``NodeStore``."""

    __slots__ = ("_store", "id")

    def __init__(self, store: NodeStore, id: int):
        self._store = store
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other._store is self._store and other.id == self.id

    def __hash__(self) -> int:
        return hash((id(self._store), self.id))

    def __repr__(self) -> str:
        return f"Node({self.id}, tokens={self._store.num_tokens(self.id)}, sampled={self.sampled})"

    @property
    def parent(self) -> Node | None:
        parent = self._store.parent[self.id]
        return None if parent == NO_NODE else Node(self._store, parent)

    @property
    def children(self) -> list[Node]:
        return [Node(self._store, child) for child in self._store.children(self.id)]

    @property
    def message(self) -> dict[str, Any] | None:
        """The message (decoded on each access; None for the root)."""
        return self._store.message(self.id)

    @property
    def token_ids(self) -> array:
        """The node's token segment (a copy)."""
        return self._store.token_ids(self.id)

    @property
    def num_prompt(self) -> int:
        """Leading tokens that were rendered, not sampled; the rest (if any) were sampled."""
        return self._store.num_prompt[self.id]

    @property
    def start(self) -> int:
        """Position of the node's first token in its conversation."""
        return self._store.start[self.id]

    @property
    def sampled(self) -> bool:
        """Whether this node holds tokens the policy sampled (an assistant turn generated here)."""
        return self._store.sampled(self.id)

    @property
    def sampled_mask(self) -> list[bool]:
        n_sampled = self._store.num_tokens(self.id) - self.num_prompt
        return [False] * self.num_prompt + [True] * n_sampled

    def _sample_slice(self, column: array) -> array | None:
        begin = self._store.sample_start[self.id]
        if begin == NO_NODE:
            return None
        return column[begin : begin + self._store.num_tokens(self.id) - self.num_prompt]

    @property
    def logprobs(self) -> array | None:
        """Logprobs of the sampled tokens (float64), or None for a node that was not sampled."""
        return self._sample_slice(self._store.logprobs)

    @property
    def policy_versions(self) -> array | None:
        """Policy version of each sampled token, or None for a node that was not sampled."""
        return self._sample_slice(self._store.policy_versions)

    @property
    def kept_counts(self) -> array | None:
        """The sampler's kept count of each sampled token (``GenerateOutput.kept_counts``), or None when no
        token was cut by top-k/top-p (or the node was not sampled)."""
        return self._store.kept_counts.get(self.id)

    @property
    def routed_experts(self) -> Any:
        """ndarray ``[len(token_ids), layers, topk]`` or None."""
        return self._store.routed_experts.get(self.id)

    @property
    def finish_reason(self) -> str | None:
        code = self._store.finish[self.id]
        return None if code < 0 else self._store.finish_names.values[code]

    @property
    def tools_key(self) -> bytes | None:
        """Sampled nodes: the tools the turn was rendered with; a bridge from it needs the same tools."""
        code = self._store.tools[self.id]
        return None if code < 0 else self._store.tools_keys.values[code]

    def path(self) -> list[Node]:
        """Nodes from the first message down to this one (the root excluded)."""
        ids = []
        node = self.id
        while node > 0:
            ids.append(node)
            node = self._store.parent[node]
        return [Node(self._store, node) for node in reversed(ids)]

    def prefix_ids(self) -> array:
        """All tokens from the start of the conversation to the end of this node."""
        return self._store.path_tokens(self.id)


class NodeList(Sequence[Node]):
    """The nodes of a store in id order (index 0 is the root), as views."""

    __slots__ = ("_store",)

    def __init__(self, store: NodeStore):
        self._store = store

    def __len__(self) -> int:
        return len(self._store)

    @overload
    def __getitem__(self, index: int) -> Node: ...
    @overload
    def __getitem__(self, index: slice) -> list[Node]: ...
    def __getitem__(self, index: int | slice) -> Node | list[Node]:
        if isinstance(index, slice):
            return [Node(self._store, i) for i in range(len(self._store))[index]]
        return Node(self._store, range(len(self._store))[index])


# ------------------------------------------------------------------------------------------ turns


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


_METHODS = ("bridge", "full")
_OUTCOMES = ("extended", "same_tokens", "forked", "new")


class TurnLog(Sequence["Turn"]):
    """Answered model calls in order, stored in columns; items are ``Turn`` views. Equal to a list of the
    same turns (``trace.turns == []`` reads naturally)."""

    def __init__(self, nodes: NodeStore):
        self.nodes = nodes
        self.node = array("i")
        self.created = array("q")
        self.prompt_len = array("i")
        self.finish = array("b")
        self.render = array("b")  # method * len(_OUTCOMES) + outcome
        self.reason = array("i")
        self.fork_position = array("i")  # -1: none
        self.response_id_bytes = array("B")
        self.response_id_end = array("i")
        self.finish_names = _Interned()
        self.reasons = _Interned()
        self.request_keys: dict[int, str] = {}
        self.options: dict[int, dict[str, Any]] = {}  # sparse: only turns whose request set some

    def append(
        self,
        node: int,
        response_id: str,
        created: int,
        finish_reason: str,
        prompt_len: int,
        render: RenderRecord,
        request_key: str | None,
        options: dict[str, Any] | None = None,
    ) -> Turn:
        index = len(self.node)
        if options:
            self.options[index] = options
        self.node.append(node)
        self.created.append(created)
        self.prompt_len.append(prompt_len)
        self.finish.append(self.finish_names.code(finish_reason))
        self.render.append(_METHODS.index(render.method) * len(_OUTCOMES) + _OUTCOMES.index(render.outcome))
        self.reason.append(self.reasons.code(render.reason))
        self.fork_position.append(-1 if render.fork_position is None else render.fork_position)
        self.response_id_bytes.frombytes(response_id.encode())
        self.response_id_end.append(len(self.response_id_bytes))
        if request_key is not None:
            self.request_keys[index] = request_key
        return Turn(self, index)

    def __len__(self) -> int:
        return len(self.node)

    @overload
    def __getitem__(self, index: int) -> Turn: ...
    @overload
    def __getitem__(self, index: slice) -> list[Turn]: ...
    def __getitem__(self, index: int | slice) -> Turn | list[Turn]:
        if isinstance(index, slice):
            return [Turn(self, i) for i in range(len(self))[index]]
        return Turn(self, range(len(self))[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TurnLog | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class Turn:
    """One answered model call, as recorded (replayed verbatim to a retried request): a view into a
    ``TurnLog``."""

    __slots__ = ("_log", "index")

    def __init__(self, log: TurnLog, index: int):
        self._log = log
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Turn) and other._log is self._log and other.index == self.index

    def __hash__(self) -> int:
        return hash((id(self._log), self.index))

    def __repr__(self) -> str:
        return f"Turn({self.index}, {self.response_id!r}, node={self._log.node[self.index]})"

    @property
    def node(self) -> Node:
        return Node(self._log.nodes, self._log.node[self.index])

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message as answered (decoded on each access)."""
        message = self._log.nodes.message(self._log.node[self.index])
        assert message is not None
        return message

    @property
    def response_id(self) -> str:
        ends = self._log.response_id_end
        begin = ends[self.index - 1] if self.index > 0 else 0
        return self._log.response_id_bytes[begin : ends[self.index]].tobytes().decode()

    @property
    def created(self) -> int:
        return self._log.created[self.index]

    @property
    def finish_reason(self) -> str:
        """The API's: stop, length, tool_calls."""
        return self._log.finish_names.values[self._log.finish[self.index]]

    @property
    def prompt_len(self) -> int:
        return self._log.prompt_len[self.index]

    @property
    def render(self) -> RenderRecord:
        method, outcome = divmod(self._log.render[self.index], len(_OUTCOMES))
        fork_position = self._log.fork_position[self.index]
        return RenderRecord(
            _METHODS[method],  # type: ignore[arg-type]
            _OUTCOMES[outcome],  # type: ignore[arg-type]
            self._log.reasons.values[self._log.reason[self.index]],
            None if fork_position < 0 else fork_position,
        )

    @property
    def request_key(self) -> str | None:
        return self._log.request_keys.get(self.index)

    @property
    def options(self) -> dict[str, Any]:
        """What the request set for this turn: ``chat_template_kwargs`` applied, the ``stop_reason`` (the
        stop string that ended the reply); empty when nothing."""
        return self._log.options.get(self.index, {})

    @property
    def completion_ids(self) -> list[int]:
        node = self.node
        return node.token_ids[node.num_prompt :].tolist()

    @property
    def logprobs(self) -> list[float]:
        logprobs = self.node.logprobs
        return logprobs.tolist() if logprobs is not None else []
