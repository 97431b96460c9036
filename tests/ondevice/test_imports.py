"""The runtime's modules import each other one way: no cycle, counting imports inside functions and for type
checking too (``trainer -> _checkpoint -> engines -> portable -> lora -> formats -> trainer`` and
``tables <-> text`` were two)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ondevice"


def _imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (relative imports, wherever they are in the file)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                for target in (base, *(f"{base}.{alias.name}" for alias in node.names)):
                    if target in modules and target != name:
                        edges[name].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_runtime_has_no_import_cycle():
    edges = _imports()
    assert "ondevice.engines.portable" in edges and edges["ondevice.trainer"]  # the walk sees the package
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
