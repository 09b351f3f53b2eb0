"""``[agent]``: agent rollouts through the TITO proxy."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from rollflow.config.base import BASE_URL, NonNegative, Positive, PositiveFloat, Section

_HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class SideCallsConfig(Section):
    """Which model calls of an agent are side calls (titles, summaries, topic checks): answered and recorded
    in the trace like any call, never trained, counted per kind (``agent_side_calls``,
    ``agent_side_calls_<kind>``). See ``rollflow.tito.side_calls``."""

    models: list[str] = []
    """Model names (or ``fnmatch`` patterns such as ``"*haiku*"``) whose calls are side calls (kind
    ``model:<name>``); the run's model serves them instead of refusing the name."""
    header: str | None = None
    """A request header (e.g. ``"x-rollflow-side-call"``) that marks a side call; its value is the kind."""
    predicate: str | None = None
    """``package.module:function`` or ``path/to/file.py:function``, called with a
    ``rollflow.tito.side_calls.SideCallRequest``; returns the kind (a string) or None for a trainable call."""


class AgentConfig(Section):
    """Agent rollouts through the TITO proxy; when this section is present it replaces single-turn generation.
    The group size is ``sampling.samples_per_prompt``; requests default to ``sampling.max_tokens`` and
    ``sampling.temperature``."""

    callable: str | None = None
    """Async ``agent(base_url, task) -> reward``: ``package.module:function`` or ``path/to/file.py:function``."""
    command: str | list[str] | None = None
    """Or a command run per trajectory (argument list, or a shell string) with ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` set and the task as JSON on stdin; it prints the reward as the
    last line of stdout."""
    env: dict[str, str] = {}
    """Extra environment variables for ``command``."""
    mode: Literal["per_branch", "single_branch", "step_wise"] = "per_branch"
    """How a trajectory's message tree becomes samples (see ``rollflow.tito.composer``)."""
    composer: str | None = None
    """A custom composer, ``package.module:function``, called like ``rollflow.tito.compose``."""
    max_seq_len: Positive | None = None
    """Longest training sample in tokens (required): longer ones are cut, or masked with ``filter_overlong``."""
    filter_overlong: bool = False
    """A sample longer than ``max_seq_len`` is masked (kept with no trainable token, counted) instead of cut
    to ``max_seq_len``."""
    timeout_s: PositiveFloat = 300.0
    """Longest one trajectory may run; a timed-out trajectory is masked and counted as a timeout."""
    max_concurrent: Positive | None = None
    """Most trajectories running at once over all prompts (unset: no limit of its own)."""
    enforce_sampling: bool = True
    """Sample every agent request at ``sampling.temperature``, ``sampling.top_p`` and ``sampling.top_k``
    whatever it asks, and without its ``min_p``, ``repetition_penalty``, penalties or ``logit_bias`` (the
    trainer's PPO ratio assumes the run's distribution); requests that asked otherwise are counted as
    ``agent_sampling_overridden``. False honours the agent's own temperature, top_p and top_k (e.g.
    generate-only evaluation) and refuses the others, which the engines do not implement."""
    strict_requests: bool = False
    """Refuse (HTTP 400 naming the field) request fields the proxy does not know and values it cannot
    enforce (``tool_choice: "required"``). False ignores them, as vLLM does, and counts them
    (``agent_unknown_fields``, ``agent_ignored_values``)."""
    host: str = "127.0.0.1"
    """Interface the TITO proxy listens on. Agents in containers or on other hosts need one they can reach
    (``0.0.0.0`` for all); each session's unguessable URL path is its credential, so expose it only on
    networks you trust."""
    advertise_url: str | None = None
    """Base URL agents are given for the proxy (``http://proxy-host:port``), when they reach it by another
    address than ``host`` (a container network, a port mapping). Unset: ``http://{host}:{port}``."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port the TITO proxy listens on; 0 picks a free one (set it when ``advertise_url`` names a port)."""
    proxy_workers: NonNegative = 0
    """Run the TITO proxy in N worker processes (0: in the run's process). Each worker listens on a port of its
    own (a free one; with one worker, ``port``) and serves the sessions opened on it, a new session going to
    the one with the fewest open; the run's process only answers their generate calls. Raise it when agents'
    turns outrun one event loop, above all with the engines in the run's process (``inference.mode =
    "local"``), where the proxy's HTTP, rendering and parsing share one interpreter with them. Streamed
    requests stream through the workers too. Above 1, ``port`` must be 0 and ``advertise_url`` unset."""
    max_sessions: Positive = 10_000
    """Most agent sessions the TITO proxy holds open at once (each holds its trace, a few KB, until it is
    closed); opening one more is refused: HTTP 429 ``too_many_sessions`` from ``rollflow proxy``'s ``POST
    /sessions``, a ``RequestError`` in a run. With ``proxy_workers`` it bounds the sessions of all workers
    together. Raise it when more agents run at once."""
    session_idle_timeout_s: PositiveFloat = 3600.0
    """Seconds an agent session may go without a request in flight before the TITO proxy closes it as timed
    out (its trace sealed, its URL answering 409 that it expired), so sessions nobody closes do not pile up.
    In a run, ``timeout_s`` ends each trajectory's session sooner; set this above the longest pause an agent
    makes between two requests."""
    side_calls: SideCallsConfig = msgspec.field(default_factory=SideCallsConfig)
    """Which calls are side calls, never trained (``[agent.side_calls]``; none by default)."""
    save_traces: Literal["none", "sampled", "all"] = "none"
    """Keep agent sessions' message trees with the run, in ``{run_dir}/traces/step_NNNNNN.jsonl`` (one JSON
    trace per line: branches, each turn's render outcome and reason, fork points, per-token policy versions,
    reward); ``rollflow trace RUN`` renders one as an HTML page. ``sampled``: the first trajectory of each
    prompt's group; ``all``: every trajectory."""


def agent_errors(config: RunConfig) -> list[str]:
    agent = config.agent
    if agent is None:
        return []
    errors = []
    if (agent.callable is None) == (agent.command is None):
        errors.append("[agent] needs exactly one of agent.callable (an async function) and agent.command")
    if agent.command is not None and not (
        agent.command.strip() if isinstance(agent.command, str) else agent.command
    ):
        errors.append("agent.command is empty")
    if agent.env and agent.command is None:
        errors.append("agent.env is only passed to agent.command; remove it or use agent.command")
    if agent.max_seq_len is None:
        errors.append(
            "agent.max_seq_len must be set: the longest training sample in tokens (e.g. inference.max_model_len)"
        )
    elif agent.max_seq_len < config.sampling.max_tokens:
        errors.append(
            f"agent.max_seq_len ({agent.max_seq_len}) must be >= sampling.max_tokens "
            f"({config.sampling.max_tokens}): one model call alone could not fit"
        )
    if config.data.reward is not None:
        errors.append(
            "data.reward is not used with [agent]: the agent returns each trajectory's reward; remove data.reward"
        )
    if not agent.host or any(c.isspace() or c == "/" for c in agent.host):
        errors.append(
            f"agent.host = {agent.host!r} must be an interface name or address like '127.0.0.1' or "
            "'0.0.0.0' (no scheme, port or path)"
        )
    if agent.advertise_url is not None and not BASE_URL.fullmatch(agent.advertise_url):
        errors.append(
            f"agent.advertise_url = {agent.advertise_url!r} must be a base URL like 'http://proxy-host:8100' "
            "(http or https, no path)"
        )
    if agent.proxy_workers > 1:
        # Each worker listens on a free port of its own: one port or one advertised URL cannot name them all.
        listener = [f"agent.port = {agent.port}"] if agent.port else []
        if agent.advertise_url is not None:
            listener.append(f"agent.advertise_url = {agent.advertise_url!r}")
        if listener:
            errors.append(
                f"agent.proxy_workers = {agent.proxy_workers} runs that many proxies, each on a free port of "
                f"its own, which {' and '.join(listener)} cannot name; set agent.port = 0 and unset "
                "agent.advertise_url, or set agent.proxy_workers = 1"
            )
    side = agent.side_calls
    if side.header is not None and not _HEADER_NAME.fullmatch(side.header):
        errors.append(
            f"agent.side_calls.header = {side.header!r} must be an HTTP header name like 'x-side-call' "
            "(letters, digits and '-')"
        )
    for i, pattern in enumerate(side.models):
        if not pattern.strip():
            errors.append(f"agent.side_calls.models[{i}] is empty; give a model name or pattern")
        elif pattern == config.model.path:
            errors.append(
                f"agent.side_calls.models[{i}] = {pattern!r} is the trained model's own name "
                f"(model.path), so every call would be a side call; name the harness's side-call model"
            )
    if side.predicate is not None and ":" not in side.predicate:
        errors.append(
            f"agent.side_calls.predicate = {side.predicate!r} must be 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    return errors
