"""``data.task`` of this example: a scratch task directory with a notes file, and a question about it."""

from __future__ import annotations

import random

from rollflow.rollout.tasks import TaskItem

FRUITS = ("apples", "pears", "plums", "figs", "limes")


class NotesTask:
    """ "How many <fruit> are in notes.txt?": the file's lines (``metadata["files"]``, written into each
    trajectory's task directory by ``run_codex.py``) and the count as the answer."""

    name = "notes"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def item(self, index: int) -> TaskItem:
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        counts = {fruit: rng.randint(2, 30) for fruit in rng.sample(FRUITS, 3)}
        asked = rng.choice(sorted(counts))
        notes = "".join(f"{fruit}: {count}\n" for fruit, count in counts.items())
        question = f"How many {asked} are in notes.txt? Answer with the number."
        return TaskItem(
            messages=[{"role": "user", "content": question}],
            answer=counts[asked],
            metadata={"files": {"notes.txt": notes}},
        )

    def reward(self, completion: str, item: TaskItem) -> float:
        raise NotImplementedError("the agent's check script (check.py) rewards each trajectory")
