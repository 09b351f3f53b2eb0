"""Whether processes are gone: a pid alive (and not a zombie), and a wait for pids to die."""

from __future__ import annotations

import time


def process_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if process_alive(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if process_alive(pid)]
