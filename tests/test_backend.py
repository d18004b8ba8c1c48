"""The one place that picks kernels: ``loraserve.worker.backend.select_backend``."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from loraserve.lora.punica import TorchPunicaWrapper
from loraserve.model.ops import TorchOps
from loraserve.worker.attention import TorchPagedAttention
from loraserve.worker.backend import select_backend

PACKAGE = Path(__file__).resolve().parent.parent / "loraserve"
# Modules that need Triton: the kernels, and loraserve's modules built on them.
TRITON_SIDE = ("triton", "loraserve.kernels", "loraserve.lora.punica_triton",
               "loraserve.model.triton_ops", "loraserve.worker.triton_attention",
               "loraserve.worker.cuda_graphs")


def _is_torch_backend(backend) -> bool:
    return (backend.name == "torch" and type(backend.ops) is TorchOps
            and backend.punica_wrapper is TorchPunicaWrapper
            and backend.attention is TorchPagedAttention and backend.decode_graphs is None)


def test_a_cpu_runs_plain_torch_even_with_triton_installed():
    assert _is_torch_backend(select_backend(torch.device("cpu")))


def test_a_cuda_device_without_triton_runs_plain_torch(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with caplog.at_level("WARNING", logger="loraserve.worker.backend"):
        backend = select_backend(torch.device("cuda"))
    assert _is_torch_backend(backend)
    assert "Triton is not installed" in caplog.text


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module]
    return []


def _function_level_triton_imports(path: Path) -> list[str]:
    """'file:function imports module' for each import of a Triton-side module
    inside a function body of ``path``."""
    found = []
    for func in ast.walk(ast.parse(path.read_text())):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            for module in _imports(node):
                if module.startswith(TRITON_SIDE):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{func.name} "
                                 f"imports {module}")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_triton_side_modules_are_imported_at_the_choice_point_only(path):
    # Elsewhere a module imports them at its top, and only modules the choice
    # point imports do (a CPU install without Triton never reaches them).
    found = _function_level_triton_imports(path)
    if path.relative_to(PACKAGE).as_posix() == "worker/backend.py":
        assert found and all(":select_backend " in f for f in found), found
    else:
        assert not found, found


def test_the_torch_side_never_imports_the_triton_side():
    triton_modules = tuple(m.replace(".", "/") for m in TRITON_SIDE if m.startswith("loraserve."))
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE.parent).with_suffix("").as_posix()
        # A Triton-side module, or one inside a Triton-side package (the kernels).
        on_triton_side = any(name == m or name.startswith(m + "/") for m in triton_modules)
        if on_triton_side or name == "loraserve/worker/backend":
            continue
        top = [m for node in ast.parse(path.read_text()).body for m in _imports(node)]
        assert not [m for m in top if m.startswith(TRITON_SIDE)], (name, top)
