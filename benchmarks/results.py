"""What every benchmark's results carry: the machine they ran on, the command
that ran them, and the JSON they print and write."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def machine() -> str:
    """The accelerator this process runs on, and torch's version."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()} (torch {torch.__version__})"


def command_words() -> list[str]:
    """This process's command line, as typed: ``python3 -m benchmarks.offline ...``
    (under ``-m``, sys.argv[0] is the module's file path, not what was typed)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None:
        run = ["-m", spec.name.removesuffix(".__main__")]
    else:
        run = sys.argv[:1]
    return [Path(sys.executable).name, *run, *sys.argv[1:]]


def command() -> str:
    return " ".join(command_words())


def write_results(results: dict, json_path: Path | None, indent: int = 2) -> None:
    """Print the results as JSON, and save them to json_path when given."""
    print(json.dumps(results, indent=indent))
    if json_path:
        json_path.write_text(json.dumps(results, indent=indent))


def finish_report(results: dict, json_path: Path | None) -> None:
    """Add the LoRA/base ratio of output throughput (when both ran), print, and save."""
    if "lora" in results:
        results["lora_over_base"] = (
            results["lora"]["output_tok_per_s"] / results["base"]["output_tok_per_s"]
        )
    write_results(results, json_path)
