"""The quickstart's case task as a verifiers environment: a taskset of prompts asking for UPPERCASE or
lowercase, scored by a ``@vf.reward`` (the fraction of letters in the asked case), played by rollflow's
in-process chat harness (``ChatHarness``: verifiers' own harnesses need ``uv`` and the network).

Train it with ``rollflow run examples/envs/verifiers_case.toml`` (``pip install 'rollflow[envs]'``).
"""

from __future__ import annotations

import verifiers.v1 as vf

from rollflow.rollout.envs.verifiers_harness import ChatHarness
from rollflow.rollout.tasks import CaseTask, case_fraction


class CaseData(vf.TaskData):
    case: str = "upper"
    """The letter case the prompt asks for: ``upper`` or ``lower``."""


class CaseVfTask(vf.Task[CaseData]):
    @vf.reward
    async def case(self, trace: vf.Trace) -> float:
        """The fraction of the reply's letters in the asked case."""
        return case_fraction(trace.last_reply, self.data.case)


class CaseTasksetConfig(vf.TasksetConfig):
    size: int = 1024
    """Prompts in the taskset."""
    seed: int = 0
    """Seed of the prompts (the quickstart's ``data.seed``)."""


class CaseTaskset(vf.Taskset[CaseVfTask, CaseTasksetConfig]):
    def load(self):
        prompts = CaseTask(self.config.seed)
        for index in range(self.config.size):
            item = prompts.item(index)
            yield CaseVfTask(CaseData(prompt=item.messages[0]["content"], case=item.answer), self.config.task)


__all__ = ["CaseTaskset", "ChatHarness"]
