"""``rollflow config --explain [KEY]``: the config reference, generated from the config sections' own field docs.

Each field of a config section is documented by the string literal that follows its declaration; they are
read from the source of every module of ``rollflow.config`` (``ast``), so the reference can never drift from
the code.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import json
import pkgutil
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from rollflow import config as config_module
from rollflow.errors import ConfigError


@dataclass(frozen=True)
class KeyDoc:
    key: str
    """Dotted key (``trainer.lr``)."""
    type: str
    default: Any
    doc: str


def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring after the field, over the modules of ``rollflow.config``."""
    docs: dict[str, dict[str, str]] = {}
    for module in pkgutil.iter_modules(config_module.__path__, f"{config_module.__name__}."):
        docs.update(_module_field_docs(importlib.import_module(module.name)))
    return docs


def _module_field_docs(module: Any) -> dict[str, dict[str, str]]:
    tree = ast.parse(inspect.getsource(module))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for statement, following in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                fields[statement.target.id] = inspect.cleandoc(following.value.value)
        docs[node.name] = fields
    return docs


def _section_type(annotation: Any) -> type | None:
    """The Section class a field holds (``AgentConfig | None`` included), else None. A list of sections
    (``data.rewards``) is a plain key: its default is a value, not a table of keys."""
    if getattr(annotation, "__origin__", None) is list:
        return None
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, config_module.Section):
            return candidate
    return None


def _type_name(annotation: Any) -> str:
    """``int >= 0`` for ``Annotated[int, Meta(ge=0)]``, ``"a" | "b"`` for literals, else the type's name."""
    metadata = getattr(annotation, "__metadata__", None)
    if metadata is not None:
        bounds = []
        for meta in metadata:
            for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(meta, name, None) is not None:
                    bounds.append(f"{symbol} {getattr(meta, name)}")
        return " ".join([_type_name(annotation.__origin__), *bounds])
    if getattr(annotation, "__origin__", None) is Literal:
        return " | ".join(json.dumps(value) for value in annotation.__args__)
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation).replace("typing.", "")
    for literal in re.findall(r"Literal\[[^\]]*\]", text):
        text = text.replace(literal, literal.removeprefix("Literal[").removesuffix("]").replace("'", '"'))
    return text


def config_reference() -> list[KeyDoc]:
    """Every config key, in declaration order, with its type, default and doc."""
    docs = _field_docs()
    keys: list[KeyDoc] = []

    def walk(cls: type, prefix: str) -> None:
        hints = msgspec.structs.fields(cls)
        for field in hints:
            key = f"{prefix}{field.name}"
            section = _section_type(field.type)
            doc = docs.get(cls.__name__, {}).get(field.name, "")
            if section is not None:
                # A key that is a name or a table (``trainer.off_policy``) keeps its plain default.
                plain = field.default if isinstance(field.default, str | int | float) else None
                kind = f"[{key}]" if plain is None else f"{_type_name(field.type)} or [{key}]"
                keys.append(KeyDoc(key, kind, plain, doc or inspect.cleandoc(section.__doc__ or "")))
                walk(section, f"{key}.")
                continue
            if field.default is not msgspec.NODEFAULT:
                default = field.default
            elif field.default_factory is not msgspec.NODEFAULT:
                default = field.default_factory()
            else:
                default = None
            keys.append(KeyDoc(key, _type_name(field.type), default, doc))

    walk(config_module.RunConfig, "")
    return keys


def explain(key: str | None = None) -> str:
    """The reference of ``key`` (a key, or a section and everything in it; None: all) as text.

    Raises:
        ConfigError: no such key (the message suggests close ones).
    """
    reference = config_reference()
    if key:
        selected = [doc for doc in reference if doc.key == key or doc.key.startswith(f"{key}.")]
        if not selected:
            close = difflib.get_close_matches(key, [doc.key for doc in reference], n=3)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else "; run `rollflow config --explain` for all"
            )
            raise ConfigError(f"rollflow config --explain {key}: no such config key{hint}")
    else:
        selected = reference
    blocks = []
    for doc in selected:
        if doc.type.startswith("["):
            head = doc.type
        else:
            head = f"{doc.key} = {json.dumps(doc.default)}  ({doc.type})"
        text = "\n".join(f"    {line}" for line in doc.doc.splitlines())
        blocks.append(f"{head}\n{text}" if text else head)
    return "\n\n".join(blocks) + "\n"
