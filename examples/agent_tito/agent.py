"""A multi-turn, tool-using agent written with the official ``openai`` SDK, trained through rollflow's TITO
proxy. It knows nothing about rollflow: it only gets a base URL.

The agent solves an arithmetic question with a ``calculator`` tool:

1. It asks the model (with the tool declared) for ``TOOL_TURNS`` turns; a tool call is executed and its result
   returned as a ``tool`` message, a plain answer gets a "check it" nudge.
2. It then *summarizes its history*: the old turns are replaced by one short notes message, as long-running
   agents do to save context. The next request is therefore not an extension of what was sampled before, so the
   proxy starts a new branch of the session's message tree (each branch becomes its own training sample).
3. It asks for the final answer and returns its reward: 0.5 if the answer contains the right number, plus
   0.5 times the fraction of letters in UPPERCASE over all its replies, the style its system prompt asks for.
   (The style half is what the tiny random-init model learns in a few dozen steps on CPU; the number half
   needs a real model.)

Run by rollflow as ``agent.callable = "agent.py:run_agent"`` (relative to the config file), or as a command
(``agent.command = ["python", "examples/agent_tito/agent.py"]``): it then reads the task as JSON on stdin and
prints the reward as the last line of stdout.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import random
import re
import sys
from types import SimpleNamespace
from typing import Any

from openai import AsyncOpenAI

from rollflow.rollout.tasks import TaskItem

TOOL_TURNS = 2
SYSTEM = "You are a careful math assistant. Use the calculator tool. Write in UPPERCASE."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate + - * arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


class ArithmeticTask:
    """``data.task`` for this example: "What is A op B?" with the integer result as the answer."""

    name = "arithmetic"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def item(self, index: int) -> TaskItem:
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        symbol = rng.choice(["+", "-", "*"])
        answer = {"+": a + b, "-": a - b, "*": a * b}[symbol]
        return TaskItem(messages=[{"role": "user", "content": f"What is {a} {symbol} {b}?"}], answer=answer)

    def reward(self, completion: str, item: TaskItem) -> float:
        return score_answer(completion, item.answer)


def score_answer(text: str, answer: Any, replies: str | None = None) -> float:
    """Half for the right number in ``text``, half for the requested style: the fraction of letters in
    UPPERCASE over all the agent's ``replies`` (default: ``text``)."""
    letters = [char for char in (text if replies is None else replies) if char.isalpha()]
    style = sum(char.isupper() for char in letters) / len(letters) if letters else 0.0
    correct = str(answer) in re.findall(r"-?\d+", text)
    return 0.5 * correct + 0.5 * style


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The tool: + - * over integers, nothing else (model output is untrusted)."""

    def evaluate(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.operand))
        raise ValueError("unsupported expression")

    try:
        return str(evaluate(ast.parse(expression[:200], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as error:
        return f"error: {error}"


def run_tool(call: Any) -> str:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if call.function.name != "calculator" or not isinstance(arguments, dict):
        return f"error: unknown tool {call.function.name!r}"
    return calculator(str(arguments.get("expression", "")))


def summarize(turns: list[dict[str, Any]]) -> str:
    """Notes replacing the old turns (plain text; a real agent might ask the model for them)."""
    notes = []
    for message in turns:
        if message["role"] == "assistant" and message.get("content"):
            notes.append(f"you said {message['content'][:40]!r}")
        elif message["role"] == "tool":
            notes.append(f"the calculator gave {message['content'][:40]}")
    return "; ".join(notes) or "nothing yet"


async def run_agent(base_url: str, task: Any) -> float:
    """One trajectory: ``TOOL_TURNS`` tool-using turns, a summary that rewrites the history, a final answer.

    No ``temperature`` and no ``max_tokens``: rollflow's proxy applies the run's sampling settings.
    """
    async with AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused")) as client:
        question = [{"role": "system", "content": SYSTEM}, *task.messages]
        messages, replies = list(question), []
        for turn in range(TOOL_TURNS):
            response = await client.chat.completions.create(
                model=task.model, messages=messages, tools=TOOLS, seed=task.seed + turn
            )
            message = response.choices[0].message
            replies.append(message.content or "")
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or ():
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Check it with the calculator."})
        # The history rewrite: old turns → one notes message. The proxy records a new branch from here.
        notes = summarize(messages[len(question) :])
        messages = [
            *question,
            {"role": "user", "content": f"Notes: {notes}. Now give the final answer, in UPPERCASE."},
        ]
        response = await client.chat.completions.create(
            model=task.model, messages=messages, seed=task.seed + TOOL_TURNS
        )
        final = response.choices[0].message.content or ""
        return score_answer(final, task.answer, " ".join([*replies, final]))


if __name__ == "__main__":
    # Command mode: the task as JSON on stdin, the model's URL and name in the environment.
    task = SimpleNamespace(**json.load(sys.stdin))
    print(asyncio.run(run_agent(os.environ["OPENAI_BASE_URL"], task)))
