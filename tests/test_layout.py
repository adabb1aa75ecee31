"""The code's structure: no import cycle among optc's modules (module-level imports; an import inside a
function runs when it is called, after every module has loaded)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"optc": "optc", "passes": "optc.passes", "kernels": "optc.kernels", "runtime": "optc.runtime"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if folder == "optc" and parts and parts[0] in ("passes", "kernels", "runtime"):
                continue
            out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports at module level (the deepest module each statement names)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(graph) > 50  # the walk saw the project
