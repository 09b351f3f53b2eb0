"""The check script of a task directory: ``python check.py EXPECTED`` reads the agent's final message
(``reply.txt``, written by ``codex exec --output-last-message``) and prints the reward as its last line:
0.5 for a reply that holds a number at all, plus 0.5 when it holds the expected one."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def reward(reply: str, expected: str) -> float:
    numbers = re.findall(r"\d+", reply)
    return 0.5 * bool(numbers) + 0.5 * (expected in numbers)


if __name__ == "__main__":
    reply_file = Path("reply.txt")
    reply = reply_file.read_text(errors="replace") if reply_file.exists() else ""
    print(reward(reply, sys.argv[1]))
