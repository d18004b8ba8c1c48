"""The paged-attention kernel: one launch for a batch of prefill, chunked
prefill and decode sequences (host side: ``paged_attention``).

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_norm_rope import rotate_half
from .pdl import pdl_begin

# The kernel's softmax works in base 2: the host scales q.k by scale * LOG2E.
LOG2E = 1.4426950408889634
# Sequences scanned per step when a tile looks up its sequence.
SEARCH_BLOCK = 128
# Masked scores are -inf; the running max starts finite so that a row that sees
# no key yet gives exp2(-inf - finite) = 0 instead of NaN.
_NEG_START = tl.constexpr(-1.0e30)


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
            # A key past the end reads block 0 and scores -inf below. Its v meets
            # p = 0: block 0 holds zeros (paged_attention's contract), so the
            # loads need no mask.
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
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
def attn_kernel(
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
    ALIGNED: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    BT_PER_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    if ONE_TILE_PER_SEQ:
        # Decode launches a sequence's KV heads next to each other: they read
        # neighbouring pieces of the same cache rows at about the same time.
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
            BLOCK_Q > 1, BT_PER_BLOCK,
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
            True, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, f_lo, f_end, bt_row, kc_ptr, vc_ptr, kv_off, d, d_ok,
            qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, EVEN_D, IEEE, False, OFFSETS_32,
            True, False,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, f_end, kv_hi, bt_row, kc_ptr, vc_ptr, kv_off, d, d_ok,
            qk_scale, window, stride_cb, stride_cs,
            BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, EVEN_D, IEEE, False, OFFSETS_32,
            True, False,
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
# each new combination would cost a 1.5-2 s compile on a request's path after start-up
# (benchmarks/profile/first_use.py lists them). Query-tiled launches take this kernel,
# which does not specialise on them; decode keeps the specialised one, whose
# values a CUDA graph fixes.
_RAGGED_INTS = ["num_seqs", "num_splits", "stride_bt", "ws_o_ss", "ws_lse_ss"]
attn_kernel_ragged = triton.jit(do_not_specialize=_RAGGED_INTS)(attn_kernel.fn)
