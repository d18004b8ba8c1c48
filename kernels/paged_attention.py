"""Attention over the paged KV cache (Triton), for prefill, chunked prefill and decode.

API
---
``write_kv_cache(k, v, kv_cache, slot_mapping)`` stores the step's new keys and
values ([T, Hk, D]) at flat slots ``block * block_size + offset`` of one layer's
cache ``[2, num_blocks, block_size, Hk, D]``; slot -1 (a padding token) is skipped.

``paged_attention(q, kv_cache, out, query_start_loc, seq_lens, block_tables,
scale, sliding_window=None, max_query_len=None, workspace=None, num_splits=None)``
writes ``out`` [T, Hq, D] in place. Sequence i's queries are
``q[query_start_loc[i]:query_start_loc[i+1]]``, the last of its ``seq_lens[i]``
tokens; the mask is causal (and keeps key ``k`` for query position ``p`` only if
``k > p - sliding_window`` when a window is given). GQA: query head h reads KV
head ``h // (Hq // Hk)``. One launch covers the whole batch, whatever its mix of
prefill, chunked prefill and decode sequences; rows of ``out`` for tokens past
``query_start_loc[B]`` carry no meaning.

Decode steps can pass ``new_kv=NewKV(k, v, positions, cos, sin, slot_mapping)``
with q and k unrotated: the same launch then rotates them, stores k and v in the
cache and attends the new key from registers, in place of the rotary kernel
and ``write_kv_cache`` before it (one launch a layer fewer).

How it runs
-----------
A program owns one tile of up to BLOCK_Q query tokens of one sequence and one
KV head, and holds the queries of all the heads of that KV head's group as rows
of one matrix, so each K/V tile read from the cache serves the whole group. It
walks the keys the tile can see (causal, window) in BLOCK_N steps, gathering
each key's row through the block table, with an fp32 online softmax.

Tiles are numbered so that sequence i owns tiles ``query_start_loc[i] // BLOCK_Q
+ i`` onwards: that range holds at least cdiv(q_len_i, BLOCK_Q) tiles, and
``T // BLOCK_Q + B`` tiles cover any batch, so the grid needs only host sizes.
A program finds its sequence by counting the starts at or before its tile.
When every sequence fits one tile (``max_query_len <= BLOCK_Q``, e.g. decode)
tile i is simply sequence i.

Split-KV: when the batch has too few (sequence, KV head) pairs to fill the GPU,
each pair's keys are cut into ``num_splits`` ranges whose length follows the
real sequence length at run time; every split writes a normalised partial
output and its log-sum-exp into ``workspace`` and counts itself in on the tile's
counter; the split that completes the count merges the partials (in split
order, so the result does not depend on which split that is) and resets the
counter. One launch, no second merge kernel.

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

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .counters import counter_buffer
from .fused_norm_rope import rotate_half
from .pdl import pdl_args, pdl_begin

# Split-KV partials are kept for at most this many (token, split) pairs, which
# bounds the workspace; batches that big fill the GPU without splitting anyway.
MAX_SPLIT_ROWS = 512
# More splits cost more in the merge than they gain in parallelism: a batch-1
# decode step of the 8B shape at 576 keys ran 2.8% faster with 8 than with 32 on
# the H200 (benchmarks/RESULTS.md, eleventh session).
MAX_SPLITS = 8
# Split counters (kernels/counters.py), one per (query tile, KV head) of a split
# launch: at most MAX_SPLIT_ROWS tokens and as many sequences, 64 KV heads.
_MAX_LOCKS = 2 * MAX_SPLIT_ROWS * 64
# Decode grids with a sequence's KV heads adjacent in launch order (see the launch).
DECODE_HEADS_ADJACENT = True
# Decode tiles start aligned, so their key addresses come from per-lane offsets
# (`_attend`'s ALIGNED); False for a side-by-side measurement only.
DECODE_ALIGNED_KEYS = True
# The decode loop's block-table entry per block (tiles of up to 64 keys) and no
# causal mask for one query a tile; False for a side-by-side measurement only.
DECODE_LOOP_TRIM = True
# Sequences scanned per step when a tile looks up its sequence.
_SEARCH_BLOCK = 128
_LOG2E = 1.4426950408889634
# Masked scores are -inf; the running max starts finite so that a row that sees
# no key yet gives exp2(-inf - finite) = 0 instead of NaN.
_NEG_START = tl.constexpr(-1.0e30)


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


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    lo,
    hi,
    bt_row,
    kc_ptr,
    vc_ptr,
    kv_off,
    d,
    d_ok,
    qk_scale,
    window,
    stride_cb,
    stride_cs,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    ALIGNED: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    BLOCK0_ZEROS: tl.constexpr,
    CAUSAL: tl.constexpr,
    BT_PER_BLOCK: tl.constexpr,
):
    """Online softmax over keys [lo, hi); unmasked ranges hold whole BLOCK_N tiles only.

    BT_PER_BLOCK (ALIGNED only): load one block-table entry per block a tile
    spans, not one per key (sm_90, Triton 3.6: the 64-key loop's 426
    instructions become 333 at 5 stages; 128-key tiles grow from 454 to 535).

    CAUSAL: mask keys past each row's query. Without it every row sees all of
    [lo, hi): right for one query a sequence, whose keys all come before it
    (padding rows see keys too, and are never stored).

    ALIGNED: every tile starts at a multiple of min(BLOCK_N, BLOCK_SIZE), one of
    which divides the other. A lane's block (counted from the tile's first) and
    its row in that block are then the same in every tile, so the per-key
    division and modulo leave the loop: at decode sizes the loop's time goes to
    issuing instructions, not to waiting for memory (benchmarks/RESULTS.md).
    """
    lane = tl.arange(0, BLOCK_N)
    lane_blk = lane // BLOCK_SIZE
    lane_off = (lane % BLOCK_SIZE) * stride_cs + kv_off
    for start in range(lo, hi, BLOCK_N):
        kpos = start + lane
        if ALIGNED:
            bt_pos = start // BLOCK_SIZE + lane_blk
        else:
            bt_pos = kpos // BLOCK_SIZE
        if MASKED and BT_PER_BLOCK:
            k_ok = kpos < hi
            # One table entry per block the tile spans, spread over its keys.
            nb: tl.constexpr = max(1, BLOCK_N // BLOCK_SIZE)
            first = start // BLOCK_SIZE + tl.arange(0, nb)
            ids = tl.load(bt_row + first, mask=first * BLOCK_SIZE < hi, other=0)
            blk = tl.reshape(tl.broadcast_to(ids[:, None], (nb, BLOCK_N // nb)), (BLOCK_N,))
            # Keys past the end read block 0 (in bounds) and score -inf below.
            blk = tl.where(k_ok, blk, 0)
        elif MASKED:
            k_ok = kpos < hi
            # Keys past the end read block 0 (in bounds) and score -inf below.
            blk = tl.load(bt_row + bt_pos, mask=k_ok, other=0)
        else:
            blk = tl.load(bt_row + bt_pos)
        if not OFFSETS_32:
            blk = blk.to(tl.int64)
        if ALIGNED:
            off = blk * stride_cb + ((start % BLOCK_SIZE) * stride_cs + lane_off)
        else:
            off = blk * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_off
        k_ptrs = kc_ptr + off[None, :] + d[:, None]
        v_ptrs = vc_ptr + off[:, None] + d[None, :]
        if MASKED and EVEN_D:
            # A key past the end scores -inf below whatever it holds. Its v meets
            # p = 0, which a NaN would survive, so v is masked unless block 0
            # holds zeros.
            k_t = tl.load(k_ptrs)
            if BLOCK0_ZEROS:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
        elif MASKED:
            k_t = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k_t = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        s = s * qk_scale
        if MASKED:
            keep = k_ok[None, :]
            if CAUSAL:
                keep = keep & (kpos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                keep = keep & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    ws_o_ptr,
    ws_lse_ptr,
    lock_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    knew_ptr,
    vnew_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    num_seqs,
    num_splits,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    ws_o_ss,
    ws_o_st,
    ws_lse_ss,
    ws_lse_st,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    NEW_KV: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_ADJACENT: tl.constexpr,
    ALIGNED: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    BLOCK0_ZEROS: tl.constexpr,
    DECODE_TRIM: tl.constexpr,
    BT_PER_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    if HEADS_ADJACENT:
        kvh = tl.program_id(0)
        tile = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)

    if ONE_TILE_PER_SEQ:
        seq = tile
        q_tile_start = 0
    else:
        # Sequence starts (in tile numbers) rise strictly, so the number of
        # starts at or before this tile, minus one, is this tile's sequence.
        count = tile * 0
        for base in range(0, num_seqs, SEARCH_BLOCK):
            idx = base + tl.arange(0, SEARCH_BLOCK)
            in_range = idx < num_seqs
            starts = tl.load(qsl_ptr + idx, mask=in_range, other=0) // BLOCK_Q + idx
            count += tl.sum(((starts <= tile) & in_range).to(tl.int32), axis=0)
        seq = count - 1
        q_tile_start = (tile - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)) * BLOCK_Q

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile_start + rows // GROUP_P2
    hg = rows % GROUP_P2
    row_ok = (hg < GROUP) & (rows // GROUP_P2 < BLOCK_Q) & (tok < q_len)
    head = kvh * GROUP + hg
    # Rows that are padding get position -1: they see no key.
    q_pos = tl.where(row_ok, ctx_len + tok, -1)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if NEW_KV:
        # Decode with the rotary and the KV write fused in: q and this token's k
        # arrive unrotated. Rotate both as the rotary kernel does, store k and v
        # at the token's slot (one split does), and keep them for the last key.
        pos = tl.load(pos_ptr + q_start)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok, other=0.0)
        q_half = tl.load(
            q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
            + partner[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        q = rotate_half(q, q_half, cos[None, :], sin[None, :], sign[None, :])
        k_row = knew_ptr + q_start * stride_kt + kvh * stride_kh
        k_new = rotate_half(tl.load(k_row + d, mask=d_ok, other=0.0),
                             tl.load(k_row + partner, mask=d_ok, other=0.0), cos, sin, sign)
        v_new = tl.load(vnew_ptr + q_start * stride_vt + kvh * stride_vh + d, mask=d_ok,
                        other=0.0)
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
        if split == 0:
            # Padding tokens (slot -1) store nothing. A full-block mask: a
            # scalar term upsets the interpreter.
            safe = tl.maximum(slot, 0)
            dst = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs
            dst = dst + kvh * stride_ch + d
            st_ok = d_ok & ((d * 0 + slot) >= 0)
            tl.store(kc_ptr + dst, k_new.to(kc_ptr.dtype.element_ty), mask=st_ok)
            tl.store(vc_ptr + dst, v_new.to(vc_ptr.dtype.element_ty), mask=st_ok)

    # Keys this tile can see: up to its last query, from the window's start.
    kv_hi = ctx_len + tl.minimum(q_len, q_tile_start + BLOCK_Q)
    kv_lo = ctx_len * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_tile_start - window + 1, 0)
        if ALIGNED:
            # The loop masks the keys below the window; tiles stay aligned.
            kv_lo = kv_lo // BLOCK_N * BLOCK_N

    # Keys every row of the tile may see need no mask; only the diagonal (and
    # the window's edge) do, so split the range into masked / unmasked parts.
    full_lo = kv_lo
    if USE_WINDOW:
        full_lo = tl.maximum(kv_hi - window, 0)
    full_hi = ctx_len + q_tile_start + 1
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_hi, kv_lo + chunk)
    f_lo = tl.maximum(full_lo, kv_lo)
    n_full = tl.maximum(tl.minimum(full_hi, kv_hi) - f_lo, 0) // BLOCK_N
    f_lo = tl.where(n_full > 0, f_lo, kv_hi)
    f_end = tl.where(n_full > 0, f_lo + n_full * BLOCK_N, kv_hi)

    m_i = tl.full([BLOCK_M], _NEG_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_off = kvh * stride_ch
    if ONE_TILE_PER_SEQ:
        # Decode: a few key tiles per program, so the loads of one loop's first
        # tile are exposed latency. One masked loop pays that once, not three times.
        # With NEW_KV the split that ends at the sequence's end takes its last
        # key from registers, not from the cache.
        cached_hi = kv_hi
        if NEW_KV:
            owns_new = (kv_lo < kv_hi) & (kv_hi == seq_len)
            cached_hi = kv_hi - owns_new.to(tl.int32)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, kv_lo, cached_hi, bt_row, kc_ptr, vc_ptr, kv_off, d,
            d_ok, qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, EVEN_D, IEEE, ALIGNED, OFFSETS_32,
            BLOCK0_ZEROS, BLOCK_Q > 1 or not DECODE_TRIM, BT_PER_BLOCK,
        )  # fmt: skip
        if NEW_KV:
            if owns_new:
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1)
                # Padding rows (position -1) see no key.
                s_new = tl.where(q_pos == seq_len - 1, s_new * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s_new - m_new)
                l_i = l_i * alpha + p
                # p rounded to v's dtype, as the key loop's second dot takes it.
                pv = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
                acc = acc * alpha[:, None] + pv
                m_i = m_new
    else:
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, kv_lo, f_lo, bt_row, kc_ptr, vc_ptr, kv_off, d, d_ok,
            qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, EVEN_D, IEEE, False, OFFSETS_32,
            BLOCK0_ZEROS, True, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, f_lo, f_end, bt_row, kc_ptr, vc_ptr, kv_off, d, d_ok,
            qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, EVEN_D, IEEE, False, OFFSETS_32,
            BLOCK0_ZEROS, True, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, f_end, kv_hi, bt_row, kc_ptr, vc_ptr, kv_off, d, d_ok,
            qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, EVEN_D, IEEE, False, OFFSETS_32,
            BLOCK0_ZEROS, True, False,
        )  # fmt: skip

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    st_mask = row_ok[:, None] & d_ok[None, :]
    tok_g = q_start + tok
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), _NEG_START)
        ws_rows = tok_g * ws_o_st + head * HEAD_DIM
        tl.store(ws_o_ptr + split * ws_o_ss + ws_rows[:, None] + d[None, :], o, mask=st_mask)
        lse_rows = tok_g * ws_lse_st + head
        tl.store(ws_lse_ptr + split * ws_lse_ss + lse_rows, lse, mask=row_ok)
        # The last split of this tile to finish merges the partials, in split
        # order (the result does not depend on which split that is), and puts
        # the tile's counter back to 0 for the next launch or graph replay.
        # The barrier puts every thread's stores before the counter's release.
        tl.debug_barrier()
        lock = lock_ptr + tile * num_kv_heads + kvh
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            m_run = tl.full([BLOCK_M], _NEG_START, dtype=tl.float32)
            w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            merged = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
            for sp in range(0, num_splits):
                # .cg: read L2, never a stale L1 line.
                lse_sp = tl.load(ws_lse_ptr + sp * ws_lse_ss + lse_rows, mask=row_ok,
                                 other=_NEG_START, cache_modifier=".cg")
                o_sp = tl.load(ws_o_ptr + sp * ws_o_ss + ws_rows[:, None] + d[None, :],
                               mask=st_mask, other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_run, lse_sp)
                keep = tl.exp2(m_run - m_new)
                w = tl.exp2(lse_sp - m_new)
                merged = merged * keep[:, None] + w[:, None] * o_sp
                w_sum = w_sum * keep + w
                m_run = m_new
            dst = out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(dst, (merged / w_sum[:, None]).to(out_ptr.dtype.element_ty), mask=st_mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
    else:
        dst = out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=st_mask)


# Prefill and mixed batches run eagerly, and their sequence count, block-table
# width and workspace strides change from step to step. Triton compiles a
# variant of a kernel for each int argument that is 1 or a multiple of 16, so
# each new combination cost a 1.5-2 s compile on a request's path after start-up
# (benchmarks/first_use.py, RESULTS). Query-tiled launches take this kernel,
# which does not specialise on them; decode keeps the specialised one, whose
# values a CUDA graph fixes.
_RAGGED_INTS = ["num_seqs", "num_splits", "stride_bt", "ws_o_ss", "ws_lse_ss"]
_attn_kernel_ragged = triton.jit(do_not_specialize=_RAGGED_INTS)(_attn_kernel.fn)


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


@dataclass(frozen=True)
class AttentionConfig:
    """Tiling of one launch: BLOCK_Q query tokens (times the GQA group) by BLOCK_N keys."""

    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


def offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset into ``cache`` (one of K or V) fits in int32."""
    span = 1 + sum((n - 1) * st for n, st in zip(cache.shape, cache.stride(), strict=True))
    return span < 2**31


def _next_pow2(x: int) -> int:
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
    group_p2 = _next_pow2(group)
    d_p2 = max(16, _next_pow2(head_dim))
    wide = d_p2 > 128 or dtype == torch.float32
    if max_query_len * group_p2 <= 16:
        # Decode (and short speculative queries): one tile per sequence. Its key
        # loop is bound by issuing instructions, so the tiling sets how many
        # programs an SM runs at once (graph replays of the 8B shape, twelfth
        # session). 64-key tiles; from one pair an SM to two, 5 stages, which
        # double-buffer K/V with every program resident (three fit an SM); above
        # two (measured at four and eight) the lighter 2-stage programs; from 8,
        # 128-key tiles (sixth session, standalone).
        block_q = _next_pow2(max_query_len)
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


def _pairs_per_sm(num_seqs: int, num_kv_heads: int, device: torch.device) -> float:
    return num_seqs * num_kv_heads / _num_sms(torch.device(device))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
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
    cfg = pick_config(mql, group, head_dim, dtype, _pairs_per_sm(num_seqs, num_kv_heads, device))
    tiles = num_seqs if mql <= cfg.block_q else max(num_seqs, num_tokens // cfg.block_q)
    work = max(1, tiles * num_kv_heads)
    if work >= _num_sms(torch.device(device)):
        # A program per SM already: a split costs its merge and gains little
        # (batch-32 decode of the 8B shape on the H200, benchmarks/RESULTS.md).
        return 1
    # About two programs per SM: more splits cost more in the merge than they
    # gain in loads in flight (measured on an H200, benchmarks/RESULTS.md).
    target = 2 * _num_sms(torch.device(device))
    splits = min(MAX_SPLITS, triton.cdiv(target, work), MAX_SPLIT_ROWS // max(1, num_tokens))
    return max(1, splits)


def workspace_numel(num_q_heads: int, head_dim: int) -> int:
    """fp32 elements of a workspace that serves every split-KV launch of a model."""
    return MAX_SPLIT_ROWS * num_q_heads * (head_dim + 1)


def make_workspace(num_q_heads: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    return torch.empty(workspace_numel(num_q_heads, head_dim), dtype=torch.float32, device=device)


def _lock_buffer(device: torch.device) -> torch.Tensor:
    return counter_buffer("paged_attention", device, _MAX_LOCKS)


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
        HEADS_P2=_next_pow2(num_kv_heads),
        HEAD_DIM_P2=_next_pow2(head_dim),
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
    block0_zeros: bool = False,
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

    ``block0_zeros``: block 0 of the cache holds zeros and is in no sequence's
    table (as ``allocate_kv_cache`` and the block allocator keep it). Key lanes
    past a sequence's end read block 0, and then load their values unmasked.
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
        mql, group, head_dim, q.dtype, _pairs_per_sm(num_seqs, num_kv_heads, q.device)
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
    group_p2 = _next_pow2(group)
    block_m = max(16, cfg.block_q * group_p2)
    one_tile = mql <= cfg.block_q
    num_tiles = num_seqs if one_tile else num_tokens // cfg.block_q + num_seqs
    assert not split or num_tiles * num_kv_heads <= _MAX_LOCKS
    assert new_kv is None or one_tile, "new_kv: a query tile per sequence (decode tiling)"
    kc, vc = kv_cache[0], kv_cache[1]
    aligned = one_tile and DECODE_ALIGNED_KEYS and (
        cfg.block_n % block_size == 0 or block_size % cfg.block_n == 0)
    # Decode launches the KV heads of a sequence next to each other: they read
    # neighbouring 256-byte pieces of the same cache rows at about the same time.
    heads_adjacent = one_tile and DECODE_HEADS_ADJACENT
    grid = ((num_kv_heads, num_tiles, num_splits) if heads_adjacent
            else (num_tiles, num_kv_heads, num_splits))
    kernel = _attn_kernel if one_tile else _attn_kernel_ragged
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
        scale * _LOG2E,
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
        HEAD_DIM_P2=max(16, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        ONE_TILE_PER_SEQ=one_tile,
        SPLIT=split,
        USE_WINDOW=sliding_window is not None,
        EVEN_D=head_dim == max(16, _next_pow2(head_dim)),
        IEEE=q.dtype == torch.float32,
        SEARCH_BLOCK=_SEARCH_BLOCK,
        NEW_KV=new_kv is not None,
        HALF=head_dim // 2,
        HEADS_ADJACENT=heads_adjacent,
        ALIGNED=aligned,
        OFFSETS_32=offsets_fit_int32(kc),
        BLOCK0_ZEROS=block0_zeros,
        DECODE_TRIM=DECODE_LOOP_TRIM,
        BT_PER_BLOCK=aligned and DECODE_LOOP_TRIM and cfg.block_n <= 64,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_args(q.device),
    )
    return out
