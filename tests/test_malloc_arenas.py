"""The CLI limits glibc's malloc arenas for its process and its children, unless the user chose a limit.

Each check runs in a fresh interpreter: the limit binds arenas created after it, process-wide, so it cannot be
tried in the test process itself."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest

from rollflow.malloc_arenas import DEFAULT_MAX_ARENAS, limit_malloc_arenas

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Starts threads that allocate at once: without the limit each gets an arena of its own (glibc's default allows
# 8 per core). glibc's ``malloc_stats`` then prints one "Arena N:" block per arena, the main one included, to
# stderr. (Counting 64 MiB-aligned heap mappings in ``/proc/self/maps`` miscounted: a kernel that aligns large
# anonymous mappings for transparent huge pages puts an unrelated one on such a boundary about once in 32.)
CHILD = """
import ctypes, json, os, sys, threading
from rollflow import cli

status = None
if sys.argv[1] == "cli":
    sys.argv = ["rollflow", "config", "--help"]
    try:
        cli.main()
    except SystemExit as exit:
        status = exit.code
barrier = threading.Barrier(8)
def churn():
    barrier.wait()
    for _ in range(2000):
        blocks = [bytearray(4096) for _ in range(16)]
        del blocks
threads = [threading.Thread(target=churn) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
sys.stdout.flush()
sys.stderr.flush()
ctypes.CDLL(None).malloc_stats()
print(json.dumps({"arena_max": os.environ.get("MALLOC_ARENA_MAX"), "status": status}))
"""


def run_child(mode: str, env: dict[str, str] | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["arenas"] = len(re.findall(r"^Arena \d+:$", result.stderr, re.MULTILINE))
    return report


def test_the_cli_limits_arenas_for_itself_and_its_children():
    limited = run_child("cli")
    assert limited["status"] == 0
    assert limited["arena_max"] == str(DEFAULT_MAX_ARENAS)  # what spawned children start with
    assert 1 <= limited["arenas"] <= DEFAULT_MAX_ARENAS, limited
    unlimited = run_child("plain")
    assert unlimited["arena_max"] is None
    assert unlimited["arenas"] > DEFAULT_MAX_ARENAS, unlimited  # the threads did spread over arenas


def test_a_limit_in_the_environment_is_the_users():
    assert run_child("cli", {"MALLOC_ARENA_MAX": "4"})["arena_max"] == "4"


def test_a_bad_limit_is_refused():
    with pytest.raises(ValueError, match="max_arenas"):
        limit_malloc_arenas(0)
