"""Load safetensors checkpoints (one file or a sharded index) into our model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from loraserve import envs
from loraserve.model.linear import ColumnParallelLinear, RowParallelLinear

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
    """Copy every checkpoint tensor into its parameter (or slice of a merged one),
    then check that nothing the model needs was missing."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    # (parameter, first row written), or (parameter, (expert, first row)) for a
    # per-expert piece of a fused MoE expert parameter.
    loaded: set[tuple[str, object]] = set()
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors",
                     disable=not (show_progress and envs.show_progress())):
        with safe_open(path, framework="pt") as f:
            for stored_name in f.keys():
                name = _our_name(model, stored_name)
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if _load_expert_piece(model, params, f, stored_name, name, loaded):
                    continue
                target, offset, slice_idx = _target_of(model, name)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                tensor = _this_ranks_shard(model, target, slice_idx, f.get_tensor(stored_name))
                start, size = offset if offset is not None else (0, params[target].shape[0])
                dest = params[target][start:start + size]
                _check_shape(name, dest.shape, tensor.shape)
                dest.copy_(tensor)
                loaded.add((target, start))
    missing = sorted(
        f"{name}[{start}:]" if start else name
        for name, start in _expected_pieces(model, params, tied)
        if (name, start) not in loaded and not _experts_complete(model, name, loaded)
    )
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:8]}")


def _expected_pieces(model, params: dict, tied: bool) -> list[tuple[str, int]]:
    """(parameter, first row) of every piece a checkpoint must provide: one per slice
    for merged projections, one for any other parameter."""
    merged = {m for m, _ in model.stacked_modules.values()}
    pieces = []
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        module = name.split(".")[-2] if "." in name else ""
        if module in merged:
            sizes = model.slice_sizes(module)
            pieces += [(name, sum(sizes[:i])) for i in range(len(sizes))]
        else:
            pieces.append((name, 0))
    return pieces


def _our_name(model, name: str) -> str:
    rename = getattr(model, "checkpoint_name", None)
    return rename(name) if rename is not None else name


def _load_expert_piece(model, params: dict, f, stored_name: str, name: str,
                       loaded: set) -> bool:
    """Copy a per-expert checkpoint tensor (MoE models) into its fused expert
    parameter; False for any other tensor."""
    locate = getattr(model, "expert_checkpoint_target", None)
    hit = locate(name) if locate is not None else None
    if hit is None:
        return False
    target, expert, start, rows = hit
    if target not in params or expert >= params[target].shape[0]:
        raise ValueError(f"checkpoint tensor {stored_name!r} has no place in the model")
    dest = params[target][expert, start:start + rows]
    tensor = f.get_tensor(stored_name)
    _check_shape(stored_name, dest.shape, tensor.shape)
    dest.copy_(tensor)
    loaded.add((target, (expert, start)))
    return True


def _experts_complete(model, name: str, loaded: set) -> bool:
    """Whether per-expert tensors filled every piece of a fused expert parameter."""
    pieces = getattr(model, "expert_pieces", None)
    wanted = pieces(name) if pieces is not None else None
    return wanted is not None and all((name, piece) in loaded for piece in wanted)


def _check_shape(name: str, want, got) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, model wants "
                         f"{tuple(want)}")


def _this_ranks_shard(model, target: str, slice_idx: int, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a full checkpoint tensor that this tensor-parallel rank holds:
    its rows of a column-parallel slice, its columns of a row-parallel weight."""
    module_path, _, kind = target.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if isinstance(module, ColumnParallelLinear):
        return module.shard_rows(tensor, slice_idx)
    if isinstance(module, RowParallelLinear) and kind == "weight":
        return module.shard_cols(tensor)
    return tensor


def _target_of(model, name: str) -> tuple[str, tuple[int, int] | None, int]:
    """Map a checkpoint tensor name to (our parameter name, (row offset, rows) or
    None, slice index)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.stacked_modules:
            merged, slice_idx = model.stacked_modules[part]
            sizes = model.slice_sizes(merged)
            # Biases and weights are both sliced along their first dimension.
            start = sum(sizes[:slice_idx])
            new = parts[:i] + [merged] + parts[i + 1:]
            return ".".join(new), (start, sizes[slice_idx]), slice_idx
    return name, None, 0


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
