"""No import cycles in rollflow, between files or between its packages (read from the source with ``ast``).

A module-level import runs when its module is imported; a cycle of them makes the import order decide
which names exist yet, and a package cycle means two parts of the design each need the other (DESIGN.md:
"Dependencies point one way"). Imports inside functions run when called and are left out, and so are those
under ``if TYPE_CHECKING:``, which never run. A package is the first level under ``rollflow``
(``rollflow.inference``, ``rollflow.launch``; a top-level module such as ``rollflow.config`` is its own).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

KNOWN_FILE_CYCLES: set[frozenset[str]] = set()
"""File-level cycles left in place on purpose, each with a comment naming who owns them."""
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = set()
"""Package-level cycles left in place on purpose, each with a comment naming who owns them."""


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a directory holding the ``rollflow`` package) by dotted name."""
    names = {}
    for path in sorted((root / "rollflow").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module runs: not in functions, not under TYPE_CHECKING."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _module_level_imports(node.body)


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module -> modules it imports at module level``, within the ``rollflow`` package under ``root``.

    ``from a.b import c`` points at ``a.b.c`` when that is a module, else at ``a.b``; relative imports are
    resolved against the importing module's package."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _module_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parent = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name in a.b: the module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def package_of(module: str) -> str:
    """``rollflow.inference.router`` -> ``inference``; ``rollflow.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The file graph with each module replaced by its package; ``rollflow/__init__`` (the lazy public API,
    which imports no component at module level) is left out."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "rollflow":
            continue
        edges = packages.setdefault(package_of(module), set())
        edges.update(
            package_of(t) for t in targets if t != "rollflow" and package_of(t) != package_of(module)
        )
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, …, a]``) for each strongly connected group of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_path_around(graph, group) for group in groups]


def _path_around(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first member back to itself, inside the group."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not a cycle")


def _unexpected(found: list[list[str]], known: set[frozenset[str]]) -> list[str]:
    return [" -> ".join(cycle) for cycle in found if frozenset(cycle) not in known]


def test_no_file_level_import_cycle():
    graph = import_graph(SRC)
    assert len(graph) > 100  # the walk found the package
    unexpected = _unexpected(cycles(graph), KNOWN_FILE_CYCLES)
    assert unexpected == [], "module-level import cycles:\n" + "\n".join(unexpected)


def test_no_package_level_import_cycle():
    graph = package_graph(import_graph(SRC))
    assert {"inference", "launch", "train", "config"} <= graph.keys()
    unexpected = _unexpected(cycles(graph), KNOWN_PACKAGE_CYCLES)
    assert unexpected == [], "import cycles between rollflow's packages:\n" + "\n".join(unexpected)


def test_the_checker_catches_a_planted_cycle(tmp_path):
    package = tmp_path / "rollflow"
    (package / "alpha").mkdir(parents=True)
    (package / "beta").mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpha" / "__init__.py").write_text("")
    (package / "beta" / "__init__.py").write_text("")
    (package / "alpha" / "one.py").write_text("from rollflow.beta.two import b\n")
    (package / "beta" / "two.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rollflow.alpha import three\n"
        "def late():\n    from rollflow.alpha import three\n"
        "from ..alpha import one\n"
    )
    (package / "alpha" / "three.py").write_text("import rollflow.beta.two\n")
    graph = import_graph(tmp_path)
    assert graph["rollflow.beta.two"] == {"rollflow.alpha.one"}  # not the function's, not TYPE_CHECKING's
    assert cycles(graph) == [["rollflow.alpha.one", "rollflow.beta.two", "rollflow.alpha.one"]]
    assert cycles(package_graph(graph)) == [["alpha", "beta", "alpha"]]
    assert _unexpected(cycles(graph), set()) == [
        "rollflow.alpha.one -> rollflow.beta.two -> rollflow.alpha.one"
    ]
