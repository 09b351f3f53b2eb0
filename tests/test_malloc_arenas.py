"""The CLI limits glibc's malloc arenas for its process and its children, unless the user chose a limit.

Each check runs in a fresh interpreter: the limit binds arenas created after it, process-wide, so it cannot be
tried in the test process itself."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from rollflow.malloc_arenas import DEFAULT_MAX_ARENAS, limit_malloc_arenas

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Starts threads that allocate at once: without the limit each gets an arena of its own (glibc's default allows
# 8 per core); ``/proc/self/maps`` shows every non-main arena as a 64 MiB-aligned heap mapping.
CHILD = """
import json, os, sys, threading
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
# A non-main arena's heap mapping is named "" and starts at a multiple of HEAP_MAX_SIZE (64 MiB).
heaps = 0
for line in open("/proc/self/maps"):
    fields = line.split()
    start, end = (int(part, 16) for part in fields[0].split("-"))
    if len(fields) == 5 and start % (64 << 20) == 0 and end - start <= 64 << 20:
        heaps += 1
print(json.dumps({"arena_max": os.environ.get("MALLOC_ARENA_MAX"), "heaps": heaps, "status": status}))
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
    import json

    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_cli_limits_arenas_for_itself_and_its_children():
    limited = run_child("cli")
    assert limited["status"] == 0
    assert limited["arena_max"] == str(DEFAULT_MAX_ARENAS)  # what spawned children start with
    assert limited["heaps"] <= DEFAULT_MAX_ARENAS - 1  # the main arena has no heap mapping
    unlimited = run_child("plain")
    assert unlimited["arena_max"] is None
    assert unlimited["heaps"] > DEFAULT_MAX_ARENAS - 1, unlimited  # the threads did spread over arenas


def test_a_limit_in_the_environment_is_the_users():
    assert run_child("cli", {"MALLOC_ARENA_MAX": "4"})["arena_max"] == "4"


def test_a_bad_limit_is_refused():
    with pytest.raises(ValueError, match="max_arenas"):
        limit_malloc_arenas(0)
