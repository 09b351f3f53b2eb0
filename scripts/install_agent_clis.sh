#!/usr/bin/env bash
# Install the agent CLIs the harness tests drive (tests/test_agent_harnesses.py) from the npm registry into a
# cache directory: $ROLLFLOW_AGENT_CLI_DIR, else .agent-clis/ in the repository (gitignored). Pinned versions,
# so CI tests what was checked; a directory that already holds them is left as it is (a second run costs ~1 s).
# Needs node >= 18 and npm. The tests find the binaries in "$DIR/node_modules/.bin".
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${ROLLFLOW_AGENT_CLI_DIR:-$PWD/.agent-clis}"
PACKAGES=(
    "@openai/codex@0.171.0"
    "@anthropic-ai/claude-code@2.1.197"
    "opencode-ai@1.18.33"
)
OPENCODE_PLUGIN="@opencode-ai/plugin@1.18.33"
if ! command -v npm >/dev/null; then
    echo "install_agent_clis: npm is not installed: install node >= 18 with npm (without the CLIs, the harness tests skip)" >&2
    exit 1
fi
mkdir -p "$DIR"
STAMP="$DIR/installed.txt"
WANTED="${PACKAGES[*]} $OPENCODE_PLUGIN"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANTED" ]]; then
    echo "agent CLIs already installed in $DIR"
    exit 0
fi
SECONDS=0
# The packages' postinstall scripts only pick a platform binary, which npm already installed as an optional
# dependency: npm 11 skips them unless allowed (allowScripts), and nothing is missing without them.
npm install --prefix "$DIR" --no-audit --no-fund --no-save --loglevel=error "${PACKAGES[@]}"
# opencode installs its plugin package into its config directory on first start (from the registry); the
# tests give it this one ($XDG_CONFIG_HOME/opencode), installed here, so their episodes download nothing.
mkdir -p "$DIR/opencode-xdg/opencode"
npm install --prefix "$DIR/opencode-xdg/opencode" --no-audit --no-fund --loglevel=error "$OPENCODE_PLUGIN"
echo "$WANTED" > "$STAMP"
for cli in codex claude opencode; do
    "$DIR/node_modules/.bin/$cli" --version >/dev/null
done
echo "agent CLIs installed in $DIR in ${SECONDS} s"
