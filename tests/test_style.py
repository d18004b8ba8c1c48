"""The tree stays ruff clean (configuration in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
