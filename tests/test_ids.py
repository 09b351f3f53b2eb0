"""``rollflow.ids``: ids unique across calls, threads and forked processes, in the shape they replace."""

from __future__ import annotations

import os
import re
import threading

from rollflow.ids import unique_hex


def test_ids_are_unique_across_calls_and_threads():
    ids: list[str] = []

    def make() -> None:
        ids.extend([unique_hex() for _ in range(20_000)])

    threads = [threading.Thread(target=make) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == len(ids) == 80_000
    assert all(re.fullmatch(r"[0-9a-f]{24}", id_) for id_ in ids[:100])


def test_a_forked_child_does_not_repeat_its_parents_ids():
    before = unique_hex()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next ids and leave at once
        os.write(write, " ".join(unique_hex() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    parent = [unique_hex() for _ in range(3)]
    assert len(child) == 3
    assert not set(child) & set(parent)
    assert child[0][:16] != before[:16] == parent[0][:16]  # the child drew its own prefix
