"""Tiling and split-KV choices of a paged-attention launch, from host sizes only
(so every replay of a CUDA graph makes the same ones)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

# Split-KV partials are kept for at most this many (token, split) pairs, which
# bounds the workspace; batches that big fill the GPU without splitting anyway.
MAX_SPLIT_ROWS = 512
# More splits cost more in the merge than they gain in parallelism: a batch-1
# decode step of the 8B shape at 576 keys runs 2.8% faster with 8 than with 32 on
# the H200 (benchmarks/RESULTS.md).
MAX_SPLITS = 8
# Split counters (loraserve/kernels/counters.py), one per (query tile, KV head) of a split
# launch: at most MAX_SPLIT_ROWS tokens and as many sequences, 64 KV heads.
MAX_LOCKS = 2 * MAX_SPLIT_ROWS * 64


@dataclass(frozen=True)
class AttentionConfig:
    """Tiling of one launch: BLOCK_Q query tokens (times the GQA group) by BLOCK_N keys."""

    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def pick_config(
    max_query_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    pairs_per_sm: float = 0.0,
) -> AttentionConfig:
    """Default tiling for a batch whose longest query is ``max_query_len`` tokens.

    ``pairs_per_sm``: the batch's (sequence, KV head) pairs per SM.
    The choices are the best of sweeps on an H200 (benchmarks/RESULTS.md).
    """
    group_p2 = next_pow2(group)
    d_p2 = max(16, next_pow2(head_dim))
    wide = d_p2 > 128 or dtype == torch.float32
    if max_query_len * group_p2 <= 16:
        # Decode (and short speculative queries): one tile per sequence. Its key
        # loop is bound by issuing instructions, so the tiling sets how many
        # programs an SM runs at once (graph replays of the Llama-3-8B shape on
        # the H200). 64-key tiles; at one or two pairs an SM, 5 stages, which
        # double-buffer K/V with every program resident (three fit an SM); above
        # two, the lighter 2-stage programs; from eight, 128-key tiles.
        block_q = next_pow2(max_query_len)
        if wide:
            return AttentionConfig(block_q, 32, 4, 3)
        if pairs_per_sm >= 8:
            return AttentionConfig(block_q, 128, 4, 3)
        if 1 <= pairs_per_sm <= 2:
            return AttentionConfig(block_q, 64, 4, 5)
        return AttentionConfig(block_q, 64, 4, 2)
    if max_query_len * group_p2 <= 64:
        return AttentionConfig(max(1, 64 // group_p2), 32 if wide else 64, 4, 2)
    if wide:
        return AttentionConfig(max(1, 64 // group_p2), 32, 4, 2)
    return AttentionConfig(max(1, 128 // group_p2), 64, 8, 3)


def kv_pairs_per_sm(num_seqs: int, num_kv_heads: int, device: torch.device) -> float:
    """(sequence, KV head) pairs of a batch per SM of ``device``."""
    return num_seqs * num_kv_heads / num_sms(torch.device(device))


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The CPU interpreter has no SMs; a small number still exercises split-KV.
    return 4


def choose_num_splits(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int | None,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Split-KV factor from host sizes only (the same for every replay of a graph)."""
    mql = num_tokens if max_query_len is None else max(1, min(max_query_len, num_tokens))
    cfg = pick_config(mql, group, head_dim, dtype, kv_pairs_per_sm(num_seqs, num_kv_heads, device))
    tiles = num_seqs if mql <= cfg.block_q else max(num_seqs, num_tokens // cfg.block_q)
    work = max(1, tiles * num_kv_heads)
    if work >= num_sms(torch.device(device)):
        # A program per SM already: a split costs its merge and gains little
        # (batch-32 decode of the 8B shape on the H200, benchmarks/RESULTS.md).
        return 1
    # About two programs per SM: more splits cost more in the merge than they
    # gain in loads in flight (measured on an H200, benchmarks/RESULTS.md).
    target = 2 * num_sms(torch.device(device))
    splits = min(MAX_SPLITS, triton.cdiv(target, work), MAX_SPLIT_ROWS // max(1, num_tokens))
    return max(1, splits)


def workspace_numel(num_q_heads: int, head_dim: int) -> int:
    """fp32 elements of a workspace that serves every split-KV launch of a model."""
    return MAX_SPLIT_ROWS * num_q_heads * (head_dim + 1)
