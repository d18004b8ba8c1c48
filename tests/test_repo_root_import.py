"""The README's Offline snippet, run from the repository root on an install
without Triton (a CPU install of ``.[gguf]``).

From the root, every top-level folder of the checkout is importable under its
own name. ``kernels`` is the name of a PyPI package that transformers probes
for, and imports from, whenever it loads its modelling code (newer releases
depend on it): no folder of the checkout may answer to that name, or
transformers would import our files in its place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run first in the child: Triton is not installed there.
NO_TRITON = r"""
import sys


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTriton())
"""

OFFLINE = r"""
import json

from loraserve import LLM, LoRARequest, SamplingParams

# Model loading imports transformers' modelling code, which probes for `kernels`.
import transformers.modeling_utils

llm = LLM(model="smollm2-135m-instruct", enable_lora=True, max_loras=2, max_lora_rank=16)
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4),
                   lora_request=LoRARequest("pirate", 1, "examples/adapters/pirate"),
                   use_tqdm=False)
print(json.dumps({
    "text": out[0].outputs[0].text,
    "triton_imported": "triton" in sys.modules,
    "kernels_module": getattr(sys.modules.get("kernels"), "__file__", None),
}))
"""


def test_readme_offline_snippet_runs_from_the_repo_root_without_triton():
    env = {**os.environ, "LORASERVE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    # `python -c` puts the working directory first on sys.path, as an
    # interactive Python started in a checkout does.
    run = subprocess.run([sys.executable, "-c", NO_TRITON + OFFLINE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["text"], report
    assert not report["triton_imported"]
    # Whatever `kernels` transformers found is not a top-level folder of the
    # checkout (an installed package is fine, in a virtual environment inside the
    # checkout too).
    if report["kernels_module"] is not None:
        assert Path(report["kernels_module"]).resolve().parent.parent != ROOT, report
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_every_subpackage_is_in_the_install():
    """A folder of loraserve with an __init__.py that pyproject.toml does not list
    would be missing from a wheel, though an editable install finds it."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "loraserve").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
