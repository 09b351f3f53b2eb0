"""The agent harnesses people train, each running a short episode through a TITO session against the tiny
model: Codex CLI (``codex exec``, a custom provider on the Responses API), Claude Code (``claude -p``, the
Anthropic Messages API), opencode (``opencode run``, an OpenAI-compatible provider on Chat Completions), the
``anthropic`` SDK and the openai SDK's ``responses`` (tools and streaming), and the ``openai-agents`` SDK on its
default (Responses) model. The tiny model's replies are noise; the loop and the protocol are what is tested.

Each episode must end with: no refused request, every model call a turn of the trace, every trainable token's
logprob recomputed by transformers on the same weights within 1e-4, and side calls (titles, under a model name
or header the session's rule names) recorded but never trained. Each prints its row of the acceptance table
(``harness row: {...}``; also appended to ``$ROLLFLOW_HARNESS_TABLE`` when set).

The model is ``rollflow:tiny-long``: tiny itself with room for the harnesses' 20-60k-token system prompts and
tool schemas. The CLIs come from ``scripts/install_agent_clis.sh`` (CI runs it); a CLI that is not installed
skips its test, saying so. Every CLI runs with its home and config in a scratch directory, with the offline
switches each documents (no telemetry, no update checks, no login).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import openai
import pytest

from rollflow.tito.side_calls import SideCallRule
from tests.helpers.harness import EpisodeRow, RecordingProxy, check_episode, cli_dir, cli_path

pytestmark = [pytest.mark.agent_cli]

MODEL = "rollflow:tiny-long"
SIDE_MODEL = "rollflow-side"  # the name harnesses are given for their small (title, summary) model
MAX_TOKENS = 12  # per call: the loop, not the replies, is under test
HARNESS_TIMEOUT_S = 240.0  # a first call prefills ~55k tokens (Claude Code); generous for a busy machine
RULE = SideCallRule(models=(SIDE_MODEL,), header="x-side-call")


@pytest.fixture(scope="module")
def long_model_dir():
    from rollflow.models.tiny import ensure_tiny_long_model

    return ensure_tiny_long_model()


@pytest.fixture(scope="module")
def long_chat(long_model_dir):
    from rollflow.tito.testing import load_tiny_chat

    return load_tiny_chat(long_model_dir)


@pytest.fixture(scope="module")
def long_engine(long_model_dir):
    """One engine for the module (engines serve any event loop): prefix caching makes each harness's later
    calls, which extend its first, cheap."""
    from rollflow.inference.engine.engine import TorchEngine
    from rollflow.models.loading import load_causal_lm

    engine = TorchEngine(load_causal_lm(long_model_dir), max_batch_size=4, max_model_len=65_536)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def reference_model(long_model_dir):
    from rollflow.models.loading import load_causal_lm

    return load_causal_lm(long_model_dir)


def _proxy(engine, chat) -> RecordingProxy:
    from rollflow.inference.client import LocalInferenceClient

    return RecordingProxy(
        LocalInferenceClient([engine]),
        chat.renderer,
        chat.tokenizer,
        model_name=MODEL,
        default_max_tokens=MAX_TOKENS,
        max_body_bytes=64 * 2**20,
        max_model_len=65_536,
        side_calls=RULE,
    )


def _cli(name: str) -> Path:
    path = cli_path(name)
    if path is None:
        pytest.skip(f"{name} is not installed: run scripts/install_agent_clis.sh (CI does)")
    return path


def _scratch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: a scratch home (no user config, credentials or history) and no proxy settings."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")}
    node = shutil.which("node")
    if node:
        keep["PATH"] = f"{Path(node).parent}:{keep.get('PATH', '')}"
    return {
        **keep,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "NO_COLOR": "1",
        **extra,
    }


async def _run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), HARNESS_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode, output.decode(errors="replace")


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("apples: 3\npears: 4\n")
    return work


@pytest.mark.slow
async def test_codex_exec_on_the_responses_api(tmp_path, long_engine, long_chat, reference_model):
    codex = _cli("codex")
    work = _workdir(tmp_path)
    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        provider = (
            '{name="rollflow",base_url="'
            + session.base_url
            + '",env_key="ROLLFLOW_KEY",wire_api="responses",'
            "request_max_retries=0,stream_max_retries=0}"
        )
        argv = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only"]
        for setting in (
            "model_provider=rollflow",
            f"model={MODEL}",
            f"model_providers.rollflow={provider}",
            "analytics.enabled=false",
            "check_for_update_on_startup=false",
        ):
            argv += ["-c", setting]
        env = _scratch_env(tmp_path, CODEX_HOME=str(tmp_path / "codex-home"), ROLLFLOW_KEY="unused")
        (tmp_path / "codex-home").mkdir()
        code, output = await _run([*argv, "How many apples are in notes.txt?"], env, work)
        trace = await proxy.close_session(session)
    assert code == 0, output
    check_episode(EpisodeRow("codex exec", "responses", True, exit_code=code), proxy, trace, reference_model)


@pytest.mark.slow
async def test_claude_code_print_mode_on_the_messages_api(tmp_path, long_engine, long_chat, reference_model):
    claude = _cli("claude")
    work = _workdir(tmp_path)
    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        env = _scratch_env(
            tmp_path,
            ANTHROPIC_BASE_URL=session.base_url.removesuffix("/v1"),
            ANTHROPIC_API_KEY="unused",
            ANTHROPIC_MODEL=MODEL,
            ANTHROPIC_DEFAULT_HAIKU_MODEL=SIDE_MODEL,
            ANTHROPIC_SMALL_FAST_MODEL=SIDE_MODEL,
            CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
            # Claude Code's documented offline switches: no telemetry, error reports, update checks or
            # other nonessential traffic.
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
        )
        # Its own system prompt, with three of its tools (all ~24 are ~46k tokens of schema in the tiny
        # tokenizer, which transformers' recomputation then pays for on every branch).
        prompt = "How many apples are in notes.txt?"
        argv = [str(claude), "-p", prompt, "--max-turns", "3", "--tools", "Bash,Read,Edit"]
        code, output = await _run(argv, env, work)
        trace = await proxy.close_session(session)
    # The tiny model never stops by itself within MAX_TOKENS: Claude Code asks it to go on, then gives up
    # with that error (exit code 1) — the loop ran to its end.
    assert code == 0 or "output token maximum" in output, output
    check_episode(
        EpisodeRow("claude -p", "anthropic messages", True, exit_code=code), proxy, trace, reference_model
    )


@pytest.mark.slow
async def test_opencode_run_on_chat_completions(tmp_path, long_engine, long_chat, reference_model):
    opencode = _cli("opencode")
    work = _workdir(tmp_path)
    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        limit = {"context": 65_536, "output": MAX_TOKENS}
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "rollflow": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "rollflow",
                    "options": {"baseURL": session.base_url, "apiKey": "unused"},
                    "models": {
                        MODEL: {"name": "tiny", "limit": limit},
                        SIDE_MODEL: {"name": "tiny (titles)", "limit": limit},
                    },
                }
            },
            "model": f"rollflow/{MODEL}",
            "small_model": f"rollflow/{SIDE_MODEL}",  # titles: side calls by model name
            "autoupdate": False,
            "share": "disabled",
        }
        (work / "opencode.json").write_text(json.dumps(config))
        env = _scratch_env(tmp_path, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1")
        seeded = cli_dir() / "opencode-xdg"  # its plugin package, installed by the install script
        if seeded.is_dir():
            env["XDG_CONFIG_HOME"] = str(seeded)
        code, output = await _run([str(opencode), "run", "How many apples are in notes.txt?"], env, work)
        trace = await proxy.close_session(session)
    assert code == 0, output
    row = check_episode(
        EpisodeRow("opencode run", "chat completions", True, exit_code=code), proxy, trace, reference_model
    )
    assert row.side_calls == {f"model:{SIDE_MODEL}": 1}, row  # its title call


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
async def test_anthropic_sdk_with_tools(long_engine, long_chat, reference_model, streamed):
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA}]
    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        import anthropic  # here, not at the top: ~2 s in every collecting worker

        async with anthropic.AsyncAnthropic(
            base_url=session.base_url.removesuffix("/v1"), api_key="unused", max_retries=0
        ) as agent:
            messages = [{"role": "user", "content": "add 2 and 3"}]
            for _ in range(3):
                request = dict(
                    model=MODEL,
                    system="Use the tools.",
                    messages=messages,
                    tools=tools,
                    max_tokens=MAX_TOKENS,
                )
                if streamed:
                    async with agent.messages.stream(**request) as stream:
                        async for _event in stream:
                            pass
                        reply = await stream.get_final_message()
                else:
                    reply = await agent.messages.create(**request)
                content = [block.model_dump(exclude_none=True) for block in reply.content]
                messages.append({"role": "assistant", "content": content})
                results = [
                    {"type": "tool_result", "tool_use_id": block.id, "content": "5"}
                    for block in reply.content
                    if block.type == "tool_use"
                ]
                messages.append({"role": "user", "content": results or "go on"})
            # A title for the conversation, marked by the session's side-call header.
            await agent.messages.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a title for: add 2 and 3"}],
                max_tokens=MAX_TOKENS,
                extra_headers={"x-side-call": "title"},
            )
        trace = await proxy.close_session(session)
    row = EpisodeRow("anthropic SDK", "anthropic messages", streamed)
    check_episode(row, proxy, trace, reference_model)
    assert row.side_calls == {"title": 1} and len(trace.leaves()) == 2, row


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
async def test_openai_sdk_responses_with_tools(long_engine, long_chat, reference_model, streamed):
    tools = [
        {"type": "function", "name": "add", "description": "Add two integers.", "parameters": ADD_SCHEMA}
    ]
    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            items: list = [{"role": "user", "content": "add 2 and 3"}]
            for _ in range(3):
                request = dict(
                    model=MODEL, instructions="Use the tools.", input=items, tools=tools, max_output_tokens=12
                )
                if streamed:
                    async with client.responses.stream(**request) as stream:
                        async for _event in stream:
                            pass
                        response = await stream.get_final_response()
                else:
                    response = await client.responses.create(**request)
                items += [item.model_dump(exclude_none=True) for item in response.output]
                calls = [item for item in response.output if item.type == "function_call"]
                items += [
                    {"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls
                ]
                if not calls:
                    items.append({"role": "user", "content": "go on"})
        trace = await proxy.close_session(session)
    row = EpisodeRow("openai SDK responses", "responses", streamed)
    check_episode(row, proxy, trace, reference_model)
    assert len(trace.leaves()) == 1, row  # each turn extends the last: one branch


async def test_openai_agents_sdk_on_its_default_responses_model(long_engine, long_chat, reference_model):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no export of traces to OpenAI

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async with _proxy(long_engine, long_chat) as proxy:
        session = await proxy.open_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            provider = agents.OpenAIProvider(openai_client=client)  # its default: the Responses API
            model = provider.get_model(MODEL)
            assert type(model).__name__ == "OpenAIResponsesModel"
            agent = agents.Agent(
                name="adder",
                instructions="Use the tools.",
                tools=[add],
                model=model,
                model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS),
            )
            result = agents.Runner.run_streamed(agent, "What is 20 + 22?", max_turns=3)
            async for _event in result.stream_events():
                pass
        trace = await proxy.close_session(session)
    check_episode(EpisodeRow("openai-agents SDK", "responses", True), proxy, trace, reference_model)
