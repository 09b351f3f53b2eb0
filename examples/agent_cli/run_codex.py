"""``agent.command`` of this example: one Codex CLI episode per trajectory, rewarded by the task directory's
check script.

rollflow starts it once per trajectory with ``OPENAI_BASE_URL`` (the trajectory's TITO session),
``OPENAI_MODEL`` and the task as JSON on stdin. It makes a scratch task directory holding the task's files
and ``check.py``, runs ``codex exec`` there with a custom provider whose base URL is the session URL (the
Responses API), its home in the scratch directory, and this directory's short ``instructions.md`` in place
of Codex's own ~18k-character instructions (``model_instructions_file``) and without its sub-agent, goal and
web-search tools (the tiny model's context holds them, but every token of them is trained context). Then it
runs ``python check.py ANSWER`` in the task directory and prints the reward it printed.

Codex comes from ``scripts/install_agent_clis.sh`` (``$ROLLFLOW_AGENT_CLI_DIR`` or ``.agent-clis/``), else
from ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CODEX_TIMEOUT_S = 300  # below agent.timeout_s' reach: rollflow's own timeout kills the whole group first


def codex_binary() -> str:
    for directory in (os.environ.get("ROLLFLOW_AGENT_CLI_DIR"), HERE.parents[1] / ".agent-clis"):
        if directory and (binary := Path(directory) / "node_modules" / ".bin" / "codex").exists():
            return str(binary)
    found = shutil.which("codex")
    if found is None:
        sys.exit("codex is not installed: run scripts/install_agent_clis.sh")
    return found


def main() -> None:
    task = json.load(sys.stdin)
    base_url, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_MODEL"]
    with tempfile.TemporaryDirectory(prefix="agent-cli-") as scratch:
        root = Path(scratch)
        work, home = root / "task", root / "codex-home"
        work.mkdir()
        home.mkdir()
        for name, text in task["metadata"]["files"].items():
            (work / name).write_text(text)
        shutil.copy(HERE / "check.py", work / "check.py")
        provider = (
            f'{{name="rollflow",base_url="{base_url}",env_key="OPENAI_API_KEY",wire_api="responses",'
            "request_max_retries=0,stream_max_retries=0}"
        )
        settings = [
            "model_provider=rollflow",
            f'model="{model}"',
            f"model_providers.rollflow={provider}",
            f'model_instructions_file="{HERE / "instructions.md"}"',
            "features.multi_agent=false",
            "features.goals=false",
            'web_search="disabled"',
            "analytics.enabled=false",
            "check_for_update_on_startup=false",
        ]
        argv = [codex_binary(), "exec", "--skip-git-repo-check", "--sandbox", "read-only"]
        argv += ["--output-last-message", str(work / "reply.txt")]
        for setting in settings:
            argv += ["-c", setting]
        argv.append(task["messages"][-1]["content"])
        env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(root), "NO_COLOR": "1"}
        done = subprocess.run(
            argv,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CODEX_TIMEOUT_S,
        )
        if done.returncode != 0:
            sys.exit(f"codex exec exited with {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
        check = subprocess.run(
            [sys.executable, "check.py", str(task["answer"])],
            cwd=work,
            capture_output=True,
            text=True,
            check=True,
        )
        print(check.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
