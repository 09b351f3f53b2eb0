"""``rollflow.eventloop``: serving processes' loop and garbage-collector set-up, in fresh interpreters (the
test process's own collector is left alone)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json
from rollflow import eventloop

held = [[index] for index in range(1000)]  # alive at set-up: frozen
before = gc.get_threshold()
eventloop.tune_gc_for_serving()
after = gc.get_threshold()
frozen = gc.get_freeze_count()
cycle = []
cycle.append(cycle)  # garbage made after set-up is still collected
del cycle
collected = gc.collect()
print(json.dumps({"before": before, "after": after, "frozen": frozen, "collected": collected}))
"""


def test_tune_gc_for_serving_freezes_the_startup_heap_and_raises_the_young_threshold():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    from rollflow.eventloop import SERVING_GEN0_THRESHOLD

    assert result["after"] == [SERVING_GEN0_THRESHOLD, *result["before"][1:]]
    assert result["before"][0] < SERVING_GEN0_THRESHOLD
    assert result["frozen"] >= 1000  # the start-up objects, ``held`` among them
    assert result["collected"] >= 1  # a cycle made afterwards is still found


def test_run_runs_the_coroutine_and_returns_its_value():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rollflow import eventloop\nasync def f(): return 7\nprint(eventloop.run(f()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "7"
