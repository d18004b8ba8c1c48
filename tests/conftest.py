"""Shared fixtures: tiny models and PEFT adapters, built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("LORASERVE_NO_PROGRESS", "1")
if not torch.cuda.is_available():
    # The Triton kernels run in the interpreter on a CPU box. Triton decides
    # interpreter or compiler as it decorates (its own library too), so set it
    # before any test file imports triton, whichever order the files run in.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from utils import make_peft_adapter, make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(models_dir) -> str:
    return make_tiny_model(models_dir / "llama", "llama")


@pytest.fixture(scope="session")
def llama_adapters(models_dir, llama_dir) -> dict[str, str]:
    """Several adapters of the tiny Llama, with different ranks and targets."""
    root = models_dir / "llama_adapters"
    return {
        "r8": make_peft_adapter(llama_dir, root / "r8", r=8, alpha=16, seed=1),
        "r16_qv": make_peft_adapter(
            llama_dir, root / "r16_qv", r=16, alpha=8, target_modules=("q_proj", "v_proj"),
            seed=2,
        ),
        "r1": make_peft_adapter(llama_dir, root / "r1", r=1, alpha=3, seed=3, scale=0.5),
        "r8_mlp": make_peft_adapter(
            llama_dir, root / "r8_mlp", r=8, alpha=8,
            target_modules=("gate_proj", "up_proj", "down_proj"), seed=4,
        ),
    }


@pytest.fixture(scope="session")
def prompts(llama_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    texts = [
        "Hello world!",
        "The quick brown fox",
        "What is the capital of France?",
        "Once upon a time there was a tiny model that learned to count",
    ]
    return [tok(t).input_ids for t in texts]
