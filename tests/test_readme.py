"""The README's quick start: CI runs its test command verbatim, and its main
command serves the built-in model with an adapter that exists in the repo."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(b.strip() for b in _bash_blocks() if "pytest" in b)
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_main_command_serves_an_adapter_that_exists():
    main = _bash_blocks()[0].strip()
    assert "loraserve serve" in main
    serve = shlex.split(main.split("&&")[-1])
    modules = serve[serve.index("--lora-modules") + 1:]
    for spec in modules:
        if spec.startswith("--"):
            break
        _, path = spec.split("=", 1)
        assert (ROOT / path / "adapter_config.json").is_file(), path
        assert (ROOT / path / "adapter_model.safetensors").is_file(), path
