"""Launch configurations of our Triton GEMMs: the LoRA shrink, expand and fused
activation, and the dense decode GEMM (dense_gemm).

A config is a small dict of block sizes, split-K factor, warps and stages. The
lookup order is:

1. a JSON file written by ``benchmarks/kernels/tune_kernels.py`` for the current GPU
   (``loraserve/kernels/configs/<device name>.json``, or the file named by the
   ``LORASERVE_LORA_CONFIG`` environment variable), keyed by shape class;
2. else the table of a sibling GPU: one that records the same compute capability
   and SM count (an H100 SXM reads the H200's: the same SMs, whose best tiles
   differ far less between the two than the heuristics differ from either);
3. a heuristic that only looks at the shapes (the default on other GPUs and on
   the CPU interpreter).

Shape classes are coarse on purpose: T is rounded to a power-of-two bucket and
the rank to its padded block width, so one JSON entry covers every layer of a
model that shares K, N and rank.
"""

from __future__ import annotations

import json
import logging
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from loraserve import envs

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).parent / "configs"
# T buckets the tuner measures; a lookup snaps T to the nearest bucket (log scale).
T_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 8192, 16384)
MAX_SPLIT_K = 64
# Sections of a tuned table: the shrink, the expand, the gate/up expand fused
# into SiLU-and-multiply (lora_activation), and the decode GEMM (dense_gemm).
TABLE_KINDS = ("shrink", "expand", "silu", "dense")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rank_block(rank: int) -> int:
    # tl.dot needs every dimension >= 16.
    return max(16, next_pow2(rank))


def t_bucket(num_tokens: int) -> int:
    """The tuned T bucket nearest to num_tokens on a log scale."""
    return min(T_BUCKETS, key=lambda b: abs(_log2(b) - _log2(num_tokens)))


def _log2(n: int) -> float:
    return math.log2(max(1, n))


def shrink_key(num_tokens: int, k: int, rank: int, num_slices: int) -> str:
    return f"T{t_bucket(num_tokens)}_K{k}_R{rank_block(rank)}_S{num_slices}"


def expand_key(num_tokens: int, n_total: int, rank: int) -> str:
    return f"T{t_bucket(num_tokens)}_N{n_total}_R{rank_block(rank)}"


def silu_key(num_tokens: int, width: int, rank: int) -> str:
    return f"T{t_bucket(num_tokens)}_I{width}_R{rank_block(rank)}"


def _device() -> tuple[str, str, int] | None:
    """(name, compute capability as "major.minor", SM count) of the current GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.name, f"{props.major}.{props.minor}", props.multi_processor_count
    except Exception:  # pragma: no cover - no usable CUDA runtime
        return None
    return None


def device_record() -> dict[str, object]:
    """What a tuned table records of the GPU it was tuned on (sibling_table reads it)."""
    device = _device()
    if device is None:
        raise RuntimeError("tuning needs a CUDA device")
    name, capability, num_sms = device
    return {"device": name, "capability": capability, "num_sms": num_sms}


def config_path_for(device_name: str) -> Path:
    safe = "".join(c if c.isalnum() else "_" for c in device_name)
    return CONFIG_DIR / f"{safe}.json"


def sibling_table(capability: str, num_sms: int, config_dir: Path = CONFIG_DIR) -> Path | None:
    """The first table (by file name) tuned on a GPU of this capability and SM count."""
    for path in sorted(config_dir.glob("*.json")):
        with open(path) as f:
            data = json.load(f)
        if data.get("capability") == capability and data.get("num_sms") == num_sms:
            return path
    return None


@lru_cache(maxsize=1)
def _tuned_table() -> dict[str, dict[str, dict[str, int]]]:
    path = envs.lora_config_path()
    if path is not None and not path.is_file():
        # Named by the user: a typo must not fall back to the heuristics unnoticed.
        raise FileNotFoundError(f"{envs.LORA_CONFIG.name}={path}: no such file")
    if path is None:
        device = _device()
        if device is None:
            return {}
        name, capability, num_sms = device
        path = config_path_for(name)
        if not path.is_file():
            path = sibling_table(capability, num_sms)
            if path is None:
                return {}
            logger.info("no kernel table for %s: using %s (same capability %s, %d SMs)",
                        name, path.name, capability, num_sms)
    with open(path) as f:
        data = json.load(f)
    return {k: data.get(k, {}) for k in TABLE_KINDS}


def reload_tuned_table() -> None:
    """Forget the cached JSON and lookups (after writing a new file)."""
    for f in (_tuned_table, _num_sms, shrink_config, expand_config, silu_config, dense_tuned,
              dense_config):
        f.cache_clear()


@lru_cache(maxsize=1)
def _num_sms() -> int:
    device = _device()
    return device[2] if device is not None else 132


def default_shrink_config(num_tokens: int, k: int, rank: int, num_slices: int) -> dict[str, int]:
    # Small token tiles win below ~2k tokens (measured on an H200): a batch that
    # mixes many adapters has many part-filled tiles, and split-K makes up for
    # the lost parallelism.
    block_r = rank_block(rank)
    block_m = 16 if num_tokens <= 256 else (32 if num_tokens <= 2048 else 64)
    if block_r >= 128:
        block_m = 16 if num_tokens <= 1024 else 32
    block_k = 128 if block_r <= 64 else 64
    # Split K until there are a few programs per SM: decode has one token tile,
    # and a single program walking all of K would be latency-bound.
    tiles = -(-num_tokens // block_m)
    target = 2 * _num_sms()
    split = 1
    max_split = max(1, min(MAX_SPLIT_K, -(-k // block_k)))
    while split * 2 <= max_split and tiles * num_slices * split < target:
        split *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "num_warps": 4,
        "num_stages": 3 if split <= 4 else 2,
        # 1: one program computes every slice of its tile (x read once).
        "FUSE_SLICES": 0,
    }


def default_expand_config(num_tokens: int, n_total: int, rank: int) -> dict[str, int]:
    block_r = rank_block(rank)
    block_m = 16 if num_tokens <= 1024 else (32 if num_tokens <= 2048 else 64)
    block_n = 32 if num_tokens <= 4 else (64 if num_tokens <= 64 else 128)
    if block_r >= 128:
        block_n = min(block_n, 64)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "N_ITERS": 1, "num_warps": 4, "num_stages": 2}


def _lookup(table: dict[str, dict[str, int]], key: str) -> dict[str, int] | None:
    if key in table:
        return table[key]
    # Same shape class, nearest tuned T bucket, but only within a factor of 4:
    # a decode config is wrong for prefill, and the heuristic is better then.
    head, _, rest = key.partition("_")
    want = int(head[1:])
    best: tuple[float, dict[str, int]] | None = None
    for k, v in table.items():
        h, _, tail = k.partition("_")
        if tail != rest:
            continue
        dist = abs(_log2(int(h[1:])) - _log2(want))
        if dist <= 2 and (best is None or dist < best[0]):
            best = (dist, v)
    return None if best is None else best[1]


# Lookups are cached: they run on every eager call of the op.
@lru_cache(maxsize=4096)
def shrink_config(num_tokens: int, k: int, rank: int, num_slices: int) -> dict[str, Any]:
    cfg = default_shrink_config(num_tokens, k, rank, num_slices)
    tuned = _lookup(_tuned_table().get("shrink", {}), shrink_key(num_tokens, k, rank, num_slices))
    if tuned:
        cfg.update(tuned)
    return cfg


@lru_cache(maxsize=4096)
def expand_config(num_tokens: int, n_total: int, rank: int) -> dict[str, Any]:
    cfg = default_expand_config(num_tokens, n_total, rank)
    tuned = _lookup(_tuned_table().get("expand", {}), expand_key(num_tokens, n_total, rank))
    if tuned:
        cfg.update(tuned)
    return cfg


@lru_cache(maxsize=4096)
def silu_config(num_tokens: int, width: int, rank: int) -> dict[str, Any]:
    """The fused gate/up expand + activation over [T, 2 * width]: by default the
    expand's config (its tiles are the expand's, two slices a block)."""
    cfg = dict(expand_config(num_tokens, 2 * width, rank))
    tuned = _lookup(_tuned_table().get("silu", {}), silu_key(num_tokens, width, rank))
    if tuned:
        cfg.update(tuned)
    return cfg


def default_dense_config(num_tokens: int, n: int, k: int, silu_mul: bool = False) -> dict[str, Any]:
    """Enough (column tile, K split) programs for two waves of SMs. With SiLU-and-mul
    (a merged gate/up [n = 2I] whose epilogue applies the activation) a program
    streams twice the rows, so one wave, of 128-row tiles (64 gate + 64 up rows),
    the fastest on an H200 (benchmarks/RESULTS.md)."""
    block_n, block_k = (128, 128) if silu_mul else (64, 128)
    waves = 1 if silu_mul else 2
    tiles = -(-n // block_n)
    split = 1
    while split < 16 and tiles * split < waves * _num_sms() and k // (2 * split) >= block_k:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 4}


def dense_key(num_tokens: int, n: int, k: int, silu_mul: bool = False) -> str:
    return f"T{token_block(num_tokens)}_N{n}_K{k}" + ("_SILU" if silu_mul else "")


def token_block(num_tokens: int) -> int:
    # tl.dot needs every dimension >= 16.
    return max(16, next_pow2(num_tokens))


def has_dense_table() -> bool:
    return bool(_tuned_table().get("dense"))


# Lookups are cached: they run on every eager call.
@lru_cache(maxsize=1024)
def dense_tuned(num_tokens: int, n: int, k: int, silu_mul: bool = False) -> dict[str, Any] | None:
    """The tuned table's entry for this shape class: a config, {"CUBLAS": 1} where
    cuBLAS won, or None (not tuned on this GPU)."""
    return _lookup(_tuned_table().get("dense", {}), dense_key(num_tokens, n, k, silu_mul))


@lru_cache(maxsize=1024)
def dense_config(num_tokens: int, n: int, k: int, silu_mul: bool = False) -> dict[str, Any]:
    cfg = default_dense_config(num_tokens, n, k, silu_mul)
    tuned = dense_tuned(num_tokens, n, k, silu_mul)
    if tuned and not tuned.get("CUBLAS"):
        cfg.update(tuned)
    return cfg
