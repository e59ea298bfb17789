"""The package is layered: no module of tfuture imports one that imports it back.

Every import counts, including function-local ones and those under ``TYPE_CHECKING``: a
cycle hidden that way is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tfuture

ROOT = Path(tfuture.__file__).parent


def module_name(path: Path) -> str:
    parts = ["tfuture", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: tfuture modules it imports}``, from the source of every module."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from tfuture.x import y" names module tfuture.x.y when that is a module.
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                if t in modules and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_tfuture_has_no_import_cycle():
    graph = import_graph()
    assert "tfuture.core.future_map" in graph and "tfuture.core.slots" in graph["tfuture.core.future_map"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_core_layers_import_only_lower_layers():
    graph = import_graph()
    assert graph["tfuture.core.errors"] == set() and graph["tfuture.core.checks"] == set()
    assert graph["tfuture.core.slots"] <= {"tfuture.core.errors", "tfuture.core.checks"}
    assert "tfuture.core.future_map" not in graph["tfuture.core.debug"]
    assert not any(m.startswith("tfuture.kernels") for m in graph["tfuture.core.slots"])
