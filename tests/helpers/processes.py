"""Whether processes are gone: a pid alive (and not a zombie), a wait for pids to die, and a process's live
descendants (to check that none outlives what started it)."""

from __future__ import annotations

import os
import time
from pathlib import Path


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


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # fields from the state on (the name may hold spaces)


def descendants(pid: int) -> dict[int, tuple[str, str]]:
    """Every live descendant of ``pid``: pid -> (start time, to tell a reused pid apart; command line)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, stack = {}, [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if (stat := _proc_stat(child)) is not None:
                found[child] = (stat[19], _cmdline(child))
                stack.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def still_running(processes: dict[int, tuple[str, str]]) -> dict[int, str]:
    """Those of ``processes`` that still exist (zombies and reused pids excluded): pid -> state and command."""
    alive = {}
    for pid, (started, cmd) in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[19] == started and stat[0] != "Z":
            alive[pid] = f"[{stat[0]}] {cmd}"
    return alive
