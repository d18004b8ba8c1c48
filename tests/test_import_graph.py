"""loraserve's import graph: no module imports another that (directly or not)
imports it back, and every import goes down the layers (a part never imports the
parts built on it). Imports inside functions and under TYPE_CHECKING count too:
they are still dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "loraserve"

# Lowest first. A module may import from its own layer or those below it.
LAYERS = [
    {"loraserve.envs", "loraserve.options", "loraserve.version", "loraserve.log"},
    {"loraserve.distributed", "loraserve.kernels"},
    {"loraserve.model"},
    {"loraserve.config"},
    {"loraserve.structured_output"},
    {"loraserve.sampling_params"},
    {"loraserve.lora"},
    {"loraserve.worker"},
    {"loraserve.executor"},
    {"loraserve.engine"},
    {"loraserve.metrics"},
    {"loraserve.entrypoints"},
    {"loraserve.cli_compat", "loraserve.cli_args"},
    {"loraserve.ray"},
    {"loraserve.cli", "loraserve"},
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# The kernels are loraserve.kernels only by packaging: they may read the
# environment settings and nothing else of loraserve.
KERNELS_MAY_IMPORT = {"loraserve.kernels", "loraserve.envs"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The loraserve modules that module `name` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                # `from pkg import mod` imports pkg.mod, not all of pkg.
                full = f"{module}.{alias.name}"
                found.add(full if full in MODULES else module)
    resolved = set()
    for module in found:
        while module and module not in MODULES:
            module = module.rpartition(".")[0]
        if module and module != name:
            resolved.add(module)
    return resolved


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    """A subpackage or top-level module of loraserve (or the package itself)."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    # Guards the checks below against an empty or unresolved graph.
    assert "loraserve.engine.engine_core" in GRAPH
    assert "loraserve.executor" in GRAPH["loraserve.engine.engine_core"]
    assert "loraserve.worker.model_runner" in GRAPH["loraserve.executor.in_process"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_every_part_has_a_layer():
    assert sorted({_unit(m) for m in MODULES} - set(LAYER_OF)) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    layer = LAYER_OF[_unit(module)]
    upward = sorted(target for target in GRAPH[module]
                    if LAYER_OF.get(_unit(target), -1) > layer)
    assert upward == [], f"{module} imports parts above it"


def test_kernels_read_only_the_environment_settings():
    outside = {(m, t) for m, targets in GRAPH.items() if _unit(m) == "loraserve.kernels"
               for t in targets if _unit(t) not in KERNELS_MAY_IMPORT}
    assert outside == set()
