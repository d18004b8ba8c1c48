"""The README's quick start: CI runs its test command verbatim, its main command
serves the built-in model with an adapter that exists in the repo, on a CPU build
of torch, and every file it points to exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# Paths in the repository that README names in backticks, e.g. `docs/lora.md`.
_REPO_PATH = re.compile(r"`((?:benchmarks|docker|docs|examples|kernels|loraserve|tests)/[\w./-]+)`")


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", _readme(), re.S)


def _commands(block: str) -> list[list[str]]:
    return [shlex.split(part) for part in block.strip().split("&&")]


def _test_command() -> str:
    return next(b.strip() for b in _bash_blocks() if "pytest" in b)


def test_ci_runs_the_readme_test_command():
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _test_command() in ci_lines


def test_main_command_serves_an_adapter_that_exists():
    main = _bash_blocks()[0].strip()
    assert "loraserve serve" in main
    serve = _commands(main)[-1]
    modules = serve[serve.index("--lora-modules") + 1:]
    for spec in modules:
        if spec.startswith("--"):
            break
        _, path = spec.split("=", 1)
        assert (ROOT / path / "adapter_config.json").is_file(), path
        assert (ROOT / path / "adapter_model.safetensors").is_file(), path


def test_main_command_installs_the_cpu_torch_before_the_package():
    # The default index serves torch's CUDA build (several GB of CUDA libraries): the
    # quick start installs the CPU wheel first, from PyTorch's index and for torch only,
    # so that installing loraserve finds torch already there.
    commands = _commands(_bash_blocks()[0])
    installs = [c for c in commands if c[:2] == ["pip", "install"]]
    torch_first = installs[0]
    assert "--index-url" in torch_first, torch_first
    assert torch_first[torch_first.index("--index-url") + 1] == CPU_TORCH_INDEX
    packages = [a for i, a in enumerate(torch_first[2:], 2)
                if not a.startswith("-") and torch_first[i - 1] != "--index-url"]
    test_pin = next(a for c in _commands(_test_command()) for a in c if a.startswith("torch=="))
    assert packages == [test_pin], packages
    package = next(i for i, c in enumerate(commands) if "-e" in c)
    assert commands.index(torch_first) < package


def test_files_the_readme_names_exist():
    text = _readme()
    links = [p for p in re.findall(r"\]\(([^)#]+)\)", text) if "://" not in p]
    named = _REPO_PATH.findall(text)
    assert links and named
    missing = sorted({p for p in links + named if not (ROOT / p).exists()})
    assert not missing, f"README.md names files that do not exist: {missing}"
    outside = re.findall(r"[`(](\.\./[^`)]*)", text)
    assert not outside, f"README.md points outside the repository: {outside}"
