"""The code's structure, read from its imports (module-level and function-level alike: an import inside a
function is still a dependency, only a later one):

- docs/ARCHITECTURE.md's layer table: each layer imports only the layers its row allows. The table is read
  from the document itself, so the two cannot drift apart.
- no import cycle among optc's modules, function-level imports included.

Each check is also run on a hand-made violating module, so a checker that found nothing would fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
# folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"optc": "optc", "passes": "optc.passes", "kernels": "optc.kernels", "runtime": "optc.runtime"}
# the layer table's "may import" words -> the import names they stand for
ALLOWED_NAMES = {"core": "optc.core", "frontend": "optc.frontend", "passes": "optc.passes",
                 "kernels' table": "optc.kernels.registry", "kernels": "optc.kernels", "runtime": "optc.runtime",
                 "frontend.quant": "optc.frontend.quant", "frontend.passmanager": "optc.frontend.passmanager"}


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


def _imports(source: str, name: str, is_package: bool, modules: set[str], type_only: bool = True) -> dict[str, int]:
    """Project modules that module `name` imports anywhere in its code -> the first line that does (the
    deepest module each statement names). Imports under `if TYPE_CHECKING:` count when `type_only` (they
    name a layer all the same), not otherwise (they never run, so they make no cycle)."""
    tree = ast.parse(source)
    skipped = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
        for target in targets:
            while target and target not in modules:  # `import optc.core.ir.x` -> the module that exists
                target = target.rpartition(".")[0]
            if target and target != name:
                out.setdefault(target, node.lineno)
    return out


def _graph(type_only: bool = True) -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _imports(path.read_text(), name, path.name == "__init__.py", set(modules), type_only)
            for name, path in modules.items()}


def layer_table(text: str) -> dict[str, tuple[str, ...]]:
    """docs/ARCHITECTURE.md's layer table: import prefix of a layer -> the prefixes it may import
    (`()` for "nothing else of optc", `("*",)` for "everything")."""
    table: dict[str, tuple[str, ...]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`optc"):
            continue
        allowed = cells[3]
        if allowed == "nothing else of optc":
            names: tuple[str, ...] = ()
        elif allowed.startswith("everything"):
            names = ("*",)
        else:
            names = tuple(ALLOWED_NAMES[w.strip()] for w in allowed.split(","))
        table[cells[1].strip("`")] = names
    # the rows without an import name (`optc/cli.py`, `optc/testing.py`): everything
    for row in re.findall(r"^\| `optc/(\w+)\.py`, `optc/(\w+)\.py` \| \|.*\| everything \|$", text, re.M):
        for module in row:
            table[f"optc.{module}"] = ("*",)
    return table


def layer_of(module: str, table: dict[str, tuple[str, ...]]) -> str | None:
    """The longest table prefix `module` falls under (None: outside every layer, such as `optc` itself)."""
    matches = [p for p in table if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def layer_violations(graph: dict[str, dict[str, int]], table: dict[str, tuple[str, ...]]) -> list[str]:
    out = []
    for module, imports in sorted(graph.items()):
        layer = layer_of(module, table)
        if layer is None or table[layer] == ("*",):
            continue
        for target, line in sorted(imports.items()):
            to = layer_of(target, table)
            if to is None or to == layer:
                continue
            if not any(target == a or target.startswith(a + ".") for a in table[layer]):
                allowed = ", ".join(table[layer]) or "nothing else of optc"
                out.append(f"{module} (line {line}) imports {target}: layer {layer} may import {allowed}")
    return out


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph.get(name, {})):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def test_the_layer_table_is_read_from_the_document():
    table = layer_table(ARCHITECTURE.read_text())
    assert table == {
        "optc.core": (),
        "optc.frontend": ("optc.core", "optc.passes", "optc.kernels.registry"),
        "optc.passes": ("optc.core", "optc.frontend.quant", "optc.frontend.passmanager", "optc.kernels"),
        "optc.kernels": ("optc.core",),
        "optc.runtime": ("optc.core", "optc.kernels"),
        "optc.commands": ("*",),
        "optc.cli": ("*",),
        "optc.testing": ("*",),
    }


def test_every_import_respects_the_layer_table():
    graph = _graph()
    assert len(graph) > 50  # the walk saw the project
    violations = layer_violations(graph, layer_table(ARCHITECTURE.read_text()))
    assert not violations, "imports that break docs/ARCHITECTURE.md's layer table:\n" + "\n".join(violations)


def test_a_function_level_import_across_layers_is_caught():
    table = layer_table(ARCHITECTURE.read_text())
    modules = set(_graph()) | {"optc.core.formats.fake"}
    source = "import torch\n\ndef lower(x):\n    from optc.commands.export.onnx_builder import float32\n    return x\n"
    graph = {"optc.core.formats.fake": _imports(source, "optc.core.formats.fake", False, modules)}
    assert graph["optc.core.formats.fake"] == {"optc.commands.export.onnx_builder": 4}
    assert layer_violations(graph, table) == [
        "optc.core.formats.fake (line 4) imports optc.commands.export.onnx_builder: layer optc.core may import "
        "nothing else of optc"]
    runtime = "def f():\n    from ..frontend import build\n"  # relative, from runtime/x.py
    graph = {"optc.runtime.x": _imports(runtime, "optc.runtime.x", False, modules)}
    assert [v.split(":")[0] for v in layer_violations(graph, table)] == [
        "optc.runtime.x (line 2) imports optc.frontend.build"]


def test_no_import_cycle_function_level_imports_included():
    cycle = find_cycle(_graph(type_only=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_import_is_caught():
    modules = {"optc.runtime.a", "optc.runtime.b"}
    graph = {"optc.runtime.a": _imports("from optc.runtime.b import f\n", "optc.runtime.a", False, modules),
             "optc.runtime.b": _imports("def g():\n    from optc.runtime import a\n", "optc.runtime.b", False,
                                        modules)}
    assert find_cycle(graph) == ["optc.runtime.a", "optc.runtime.b", "optc.runtime.a"]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from optc.runtime import a\n"
    graph["optc.runtime.b"] = _imports(typed, "optc.runtime.b", False, modules, type_only=False)
    assert graph["optc.runtime.b"] == {} and find_cycle(graph) is None  # a type-only import never runs
