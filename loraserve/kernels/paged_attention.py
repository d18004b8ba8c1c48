"""Attention over the paged KV cache (Triton), for prefill, chunked prefill and decode.

API
---
``write_kv_cache(k, v, kv_cache, slot_mapping)`` stores the step's new keys and
values ([T, Hk, D]) at flat slots ``block * block_size + offset`` of one layer's
cache ``[2, num_blocks, block_size, Hk, D]``; slot -1 (a padding token) is skipped.

``paged_attention(q, kv_cache, out, query_start_loc, seq_lens, block_tables,
scale, sliding_window=None, max_query_len=None, workspace=None, ...)`` writes
``out`` [T, Hq, D] in place. Sequence i's queries are
``q[query_start_loc[i]:query_start_loc[i+1]]``, the last of its ``seq_lens[i]``
tokens; the mask is causal (and keeps key ``k`` for query position ``p`` only if
``k > p - sliding_window`` when a window is given). GQA: query head h reads KV
head ``h // (Hq // Hk)``. One launch covers the whole batch, whatever its mix of
prefill, chunked prefill and decode sequences; rows of ``out`` for tokens past
``query_start_loc[B]`` carry no meaning. Block 0 of the cache holds zeros and
is in no sequence's table (``loraserve.worker.attention.allocate_kv_cache``):
key lanes past a sequence's end read it, unmasked.

The kernel and how it walks the cache are in ``attention_kernel``; the tiling
and split-KV choices in ``attention_tiling``.

Decode steps can pass ``new_kv=NewKV(k, v, positions, cos, sin, slot_mapping)``
with q and k unrotated: the same launch then rotates them, stores k and v in the
cache and attends the new key from registers, in place of the rotary kernel
and ``write_kv_cache`` before it (one launch a layer fewer).

CUDA graphs
-----------
Grids and the number of splits depend only on host ints (T, B, head counts and
``max_query_len``), and nothing is allocated when a workspace is passed:

    ws = make_workspace(num_q_heads, head_dim, device)     # once, shared by all layers
    paged_attention(..., max_query_len=1, workspace=ws)    # decode graphs

``max_query_len`` is a host-side upper bound on the query length of any
sequence in the batch (1 for decode); leaving it out uses T, which is correct
but picks the slower prefill tiling for decode. Padded sequences (query length
0, seq_len 0) produce nothing and read nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_kernel import LOG2E, SEARCH_BLOCK, attn_kernel, attn_kernel_ragged
from .attention_tiling import (
    MAX_LOCKS,
    AttentionConfig,
    choose_num_splits,
    kv_pairs_per_sm,
    next_pow2,
    pick_config,
    workspace_numel,
)
from .counters import counter_buffer
from .pdl import pdl_args, pdl_begin


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens (slot -1) store nothing; clamp so no address is negative.
    safe = tl.maximum(slot, 0)
    h = tl.arange(0, HEADS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    # Compare a full block with the slot: a scalar mask term upsets the interpreter.
    ok = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    ok = ok & ((h[:, None] * 0 + slot) >= 0)
    dst = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs
    dst = dst + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class NewKV:
    """A decode step's own keys and values, for ``paged_attention(..., new_kv=)``:
    k and v [T, Hk, D] as the QKV projection gives them (k not yet rotated), the
    tokens' positions, the rotary's fp32 cos/sin tables [max_pos, D] (rotate-half
    convention, all of D rotated) and their cache slots (-1: padding)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


def offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset into ``cache`` (one of K or V) fits in int32."""
    span = 1 + sum((n - 1) * st for n, st in zip(cache.shape, cache.stride(), strict=True))
    return span < 2**31


def make_workspace(num_q_heads: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    return torch.empty(workspace_numel(num_q_heads, head_dim), dtype=torch.float32, device=device)


def _lock_buffer(device: torch.device) -> torch.Tensor:
    return counter_buffer("paged_attention", device, MAX_LOCKS)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hk, D] at ``slot_mapping`` [T] (-1 skips) of ``kv_cache``."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    kc, vc = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=next_pow2(num_kv_heads),
        HEAD_DIM_P2=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        **pdl_args(k.device),
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    new_kv: NewKV | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``q`` [T, Hq, D] over the paged cache; fills ``out``.

    ``query_start_loc`` int32 [B+1], ``seq_lens`` int32 [B], ``block_tables``
    int32 [B, max_blocks]. ``max_query_len``: host bound on any query length
    (picks the tiling; None = T). ``workspace``: fp32, at least
    ``workspace_numel(Hq, D)`` elements, needed (for graph capture) when the
    launch splits the keys; without one a split launch allocates its own.
    ``num_splits`` and ``config`` override the defaults (tests, tuning).

    ``new_kv`` (decode only: one query token per sequence): q arrives unrotated,
    and the launch also does the rotary and the KV write. It rotates q and the
    new k, stores k and v at their slots and takes the last key from registers,
    so the rotary kernel's launch goes (``rotary_embedding_`` then
    ``write_kv_cache`` then this, in one kernel).

    Block 0 of the cache must hold zeros and be in no sequence's table (as
    ``allocate_kv_cache`` and the block allocator keep it): key lanes past a
    sequence's end read block 0 and load their values unmasked.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    assert cache_head_dim == head_dim and num_q_heads % num_kv_heads == 0
    assert out.shape == q.shape and q.dtype == kv_cache.dtype
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] == num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    mql = num_tokens if max_query_len is None else max(1, min(max_query_len, num_tokens))
    cfg = config or pick_config(
        mql, group, head_dim, q.dtype, kv_pairs_per_sm(num_seqs, num_kv_heads, q.device)
    )
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tokens, num_seqs, num_kv_heads, mql, group, head_dim, q.dtype, q.device
        )
    split = num_splits > 1
    if split:
        need = num_splits * num_tokens * num_q_heads * (head_dim + 1)
        if workspace is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("paged_attention: pass a workspace when capturing a graph")
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        if workspace.numel() < need or workspace.dtype != torch.float32:
            raise ValueError(f"paged_attention: workspace needs {need} fp32 elements")
        n_o = num_splits * num_tokens * num_q_heads * head_dim
        ws_o = workspace[:n_o]
        ws_lse = workspace[n_o:need]
        locks = _lock_buffer(q.device)
    else:
        ws_o = ws_lse = locks = out  # unused by the kernel
    if new_kv is None:
        knew = vnew = pos = cos = sin = slots = q  # unused by the kernel
        kv_strides = (0, 0, 0, 0, 0)
    else:
        knew, vnew, pos, slots = new_kv.k, new_kv.v, new_kv.positions, new_kv.slot_mapping
        cos, sin = new_kv.cos, new_kv.sin
        assert mql == 1, "new_kv: decode batches only (one query token a sequence)"
        assert knew.shape == vnew.shape == (num_tokens, num_kv_heads, head_dim)
        assert knew.stride(2) == 1 and vnew.stride(2) == 1 and cos.stride(1) == 1
        assert cos.shape[1] == head_dim and head_dim % 2 == 0
        kv_strides = (knew.stride(0), knew.stride(1), vnew.stride(0), vnew.stride(1),
                      cos.stride(0))
    group_p2 = next_pow2(group)
    block_m = max(16, cfg.block_q * group_p2)
    one_tile = mql <= cfg.block_q
    num_tiles = num_seqs if one_tile else num_tokens // cfg.block_q + num_seqs
    assert not split or num_tiles * num_kv_heads <= MAX_LOCKS
    assert new_kv is None or one_tile, "new_kv: a query tile per sequence (decode tiling)"
    kc, vc = kv_cache[0], kv_cache[1]
    aligned = one_tile and (cfg.block_n % block_size == 0 or block_size % cfg.block_n == 0)
    # Decode puts a sequence's KV heads next to each other in launch order.
    grid = ((num_kv_heads, num_tiles, num_splits) if one_tile
            else (num_tiles, num_kv_heads, num_splits))
    kernel = attn_kernel if one_tile else attn_kernel_ragged
    kernel[grid](
        q,
        kc,
        vc,
        out,
        ws_o,
        ws_lse,
        locks,
        query_start_loc,
        seq_lens,
        block_tables,
        knew,
        vnew,
        pos,
        cos,
        sin,
        slots,
        num_seqs,
        num_splits,
        scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        *kv_strides,
        out.stride(0),
        out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        block_tables.stride(0),
        num_tokens * num_q_heads * head_dim,
        num_q_heads * head_dim,
        num_tokens * num_q_heads,
        num_q_heads,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        ONE_TILE_PER_SEQ=one_tile,
        SPLIT=split,
        USE_WINDOW=sliding_window is not None,
        EVEN_D=head_dim == max(16, next_pow2(head_dim)),
        IEEE=q.dtype == torch.float32,
        SEARCH_BLOCK=SEARCH_BLOCK,
        NEW_KV=new_kv is not None,
        HALF=head_dim // 2,
        ALIGNED=aligned,
        OFFSETS_32=offsets_fit_int32(kc),
        BT_PER_BLOCK=aligned and cfg.block_n <= 64,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_args(q.device),
    )
    return out
