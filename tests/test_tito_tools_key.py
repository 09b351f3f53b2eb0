"""``tools_key``: equal for the same tools however their keys are ordered, different for any other tools or
renderer variant."""

from __future__ import annotations

import hashlib
import json

from rollflow.tito.renderer import tools_key


def _tool(name: str, **parameters: dict) -> dict:
    return {"name": name, "description": "d", "parameters": {"type": "object", "properties": parameters}}


def test_tools_key_compares_tools_not_their_spelling():
    tools = [
        _tool("add", a={"type": "integer"}, b={"type": "integer"}),
        _tool("echo", text={"type": "string"}),
    ]
    reordered = [
        {"parameters": {"properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "type": "object"},
         "description": "d", "name": "add"},
        _tool("echo", text={"type": "string"}),
    ]  # fmt: skip
    assert tools_key(tools) == tools_key(reordered)
    others = [
        tools[:1],
        tools[::-1],
        [_tool("add", a={"type": "number"}, b={"type": "integer"}), tools[1]],
        [_tool("add", a={"type": "integer"}), tools[1]],
        [],
    ]
    keys = {tools_key(other) for other in others} | {tools_key(tools), tools_key(None)}
    assert len(keys) == len(others) + 2
    assert tools_key(None) == hashlib.blake2b(json.dumps(None).encode(), digest_size=16).digest()
    assert tools_key(tools, "enable_thinking=False") == tools_key(tools) + b"enable_thinking=False"
    assert tools_key(tools, "enable_thinking=False") != tools_key(tools, "enable_thinking=True")
