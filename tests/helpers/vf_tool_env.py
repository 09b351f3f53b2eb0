"""A multi-turn tool environment written with verifiers' own classes (``verifiers.v1``): a ``Toolset`` MCP
server with one ``@vf.tool`` (``add``), tasks that ask for a sum, and a ``@vf.reward`` that checks the final
reply holds it. Played by rollflow's in-process ``ChatHarness``. Loaded by path
(``env.id = "tests/helpers/vf_tool_env.py"``); run as ``python -m vf_tool_env`` it serves the toolset (how
verifiers starts a toolset in the subprocess runtime)."""

from __future__ import annotations

import verifiers.v1 as vf

from rollflow.rollout.envs.verifiers_harness import ChatHarness


class AddToolsetConfig(vf.ToolsetConfig):
    pass


class AddToolset(vf.Toolset[AddToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumData(vf.TaskData):
    a: int = 0
    b: int = 0


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [AddToolset(AddToolsetConfig())]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the final reply holds the sum."""
        return float(str(self.data.a + self.data.b) in trace.last_reply)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        """1 when a tool answered during the episode."""
        return float(any(message.role == "tool" for message in trace.messages))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in [(2, 3), (40, 2)]:
            yield SumTask(SumData(prompt=f"What is {a} + {b}? Use the add tool.", a=a, b=b), self.config.task)


__all__ = ["ChatHarness", "SumTaskset"]

if __name__ == "__main__":
    AddToolset.run()
