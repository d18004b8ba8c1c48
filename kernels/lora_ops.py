"""Fused multi-LoRA linear update for mixed adapters in one batch (Triton).

API
---
``add_lora_linear(y, x, lora_a, lora_b, token_slots, meta=None)`` adds, in place,

    y[t, slice_i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T    for s = token_slots[t] >= 0

* ``x``: [T, K]; ``y``: [T, sum N_i] (rows may be strided; any column stride);
* ``lora_a``: list of [S, R, K] (one per output slice, all the same shape and
  strides); ``lora_b``: list of [S, N_i, R]; slice i writes columns
  ``sum(N_0..N_{i-1}) .. + N_i`` of y. A lower-rank adapter is zero-padded.
* ``token_slots``: int [T], -1 = no adapter. Rows of such tokens are never
  read or written, so they stay bit-identical.
* fp16, bf16 or fp32 (x, y, A and B of one dtype). The scale is 1.0 (folded
  into B upstream).

How it runs: tokens are grouped by slot (``LoRAMetadata``, one sort per step),
then two launches per call (per group of up to 3 slices):

1. shrink: for each (slot, tile of up to BLOCK_M tokens, K split, slice),
   ``x_tile @ A[slot].T`` in fp32; with ``FUSE_SLICES`` one program covers
   every slice of its tile, loading each x block once. With split-K each
   split writes a partial;
   the last split to arrive (an atomic counter per tile and slice, reset by
   that program) sums them in a fixed order, so results are deterministic;
2. expand: for each (slot, token tile, N_ITERS blocks of BLOCK_N columns of
   y), read the fp32 shrink, round it once to the weight dtype, multiply by
   ``B[slot].T`` and add to y (fp32 add, one rounding).

Each tile reads its adapter's A/B once, so decode batches (one token per
request) and prefill batches share one code path; split-K gives decode enough
programs to use the whole GPU. (A one-launch variant, each program redoing its
tile's shrink, lost to it at every point tuned on an H200 and was removed.)

At decode batch sizes (``ONE_LAUNCH_TOKENS``) the two run as one launch
instead (``launch_one``): the shrink programs come first in the grid, and each
expand program waits on a per-tile flag that the programs writing its tile's
final shrink raise. That saves the gap between two dependent launches, a good
part of the op at these sizes. It relies on a grid's blocks starting in index
order (so a waiting program only waits for programs already running), which
is how NVIDIA GPUs dispatch them.

``lora_shrink`` and ``lora_expand`` are the two halves as separate calls, so the
shrink can run on another stream beside the base projection, which also only
reads x (``loraserve.lora.punica``).

Launch configs come from ``lora_config`` (a tuned JSON per GPU in
``kernels/configs/``, else heuristics).

CUDA graphs
-----------
The launch grids depend only on T, S and the shapes (host ints): at most
``cdiv(T, BLOCK_M) + S`` token tiles, of which programs past the real number of
tiles exit at once. The op allocates nothing when given a metadata object:

    meta = LoRAMetadata(max_tokens=T, num_slots=S, device="cuda")   # once
    meta.update(token_slots)                                         # every step
    add_lora_linear(y, x, lora_a, lora_b, token_slots, meta)         # every layer

``meta.update`` uses only static-shape torch ops (sort, searchsorted), so it
can run eagerly before ``graph.replay()`` or be captured in the graph itself.
Keep the same ``meta`` object (same buffers) for a captured graph; the op
reads T from ``x`` and checks it against the last ``update``. One ``meta`` per
stream: the workspace and split-K counters are reused by every call.
The fp32 workspace lives in ``meta`` and grows on the first (eager) call that
needs more; run one warm-up step over every layer shape before capturing (as
torch requires anyway), or pass ``workspace_numel`` (see ``workspace_numel``)
when building the metadata. Growing it during capture raises.

Without ``meta`` the op builds one itself (allocates: eager use only).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_config import expand_config, next_pow2, rank_block, shrink_config, silu_config
from .lora_meta import LoRAMetadata, build_lora_metadata

# Slices handled by one launch pair; more slices use more launch pairs.
MAX_SLICES_PER_LAUNCH = 3
# Token counts at which a call's shrink and expand share one launch (one_launch).
ONE_LAUNCH_TOKENS = (64, 256)

_PER_SLICE_INTS = [
    "n0", "n1", "n2", "yo0", "yo1", "yo2", "sbs0", "sbs1", "sbs2", "nb0", "nb1", "nb_total",
]
# Triton compiles a variant per value class (1, multiple of 16, other) of each int
# argument it specializes. Batch-size ints vary across CUDA graph sizes: leaving
# them unspecialized keeps graph capture at one compile per launch config.
_BATCH_INTS = ["num_tokens", "num_slots"]


@triton.jit
def _slot_tile(
    pid_m,
    slot_start_ptr,
    slot_count_ptr,
    num_slots,
    num_tokens,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WITH_REST: tl.constexpr,
):
    """Map a token-tile index to (slot, first sorted position, rows left).

    Tiles are numbered slot by slot; every slot with c tokens owns cdiv(c, BLOCK_M)
    tiles. A program whose index is past the last tile gets slot == num_slots;
    with WITH_REST the tokens without an adapter (sorted last) own the tiles
    after those, as slot num_slots, and rows_left <= 0 marks the spare programs.
    """
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_slots
    cnt = tl.load(slot_count_ptr + offs_s, mask=smask, other=0)
    start = tl.load(slot_start_ptr + offs_s, mask=smask, other=0)
    ntiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntiles, axis=0)
    slot = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = offs_s == slot
    row0 = (pid_m - tl.sum(tl.where(sel, cum - ntiles, 0), axis=0)) * BLOCK_M
    rows_left = tl.sum(tl.where(sel, cnt, 0), axis=0) - row0
    pos0 = tl.sum(tl.where(sel, start, 0), axis=0) + row0
    if WITH_REST:
        if slot >= num_slots:
            row0 = (pid_m - tl.sum(ntiles, axis=0)) * BLOCK_M
            pos0 = tl.sum(cnt, axis=0) + row0
            rows_left = num_tokens - pos0
    return slot, pos0, rows_left


@triton.jit
def _pick(i, v0, v1, v2):
    # Runtime choice among up to three per-slice values (pointers or ints).
    v = v0
    if i == 1:
        v = v1
    if i == 2:
        v = v2
    return v


@triton.jit
def _shrink_tile(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    tok,
    row_mask,
    slot,
    k_lo,
    k_len,
    K,
    R,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_R] = x[tok, k_lo:k_lo+k_len] @ A[slot, :, same K range].T
    for the first COUNT of (a0, a1, a2); each x block is loaded once for all of them
    (the accumulators past COUNT stay zero and are compiled away)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    x_ptrs = x_ptr + tok[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    a_offs = (
        slot.to(tl.int64) * stride_as
        + offs_r[:, None] * stride_ar
        + (k_lo + offs_k)[None, :] * stride_ak
    )
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            x_mask = row_mask[:, None]
            a_mask = r_mask[:, None]
        else:
            k_mask = (k_lo + k + offs_k) < K
            x_mask = row_mask[:, None] & k_mask[None, :]
            a_mask = r_mask[:, None] & k_mask[None, :]
        xb = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if DOT_FP32:
            xb = xb.to(tl.float32)
        acc0 = _shrink_step(xb, a0_ptr + a_offs, a_mask, acc0, PRECISION, DOT_FP32)
        if COUNT > 1:
            acc1 = _shrink_step(xb, a1_ptr + a_offs, a_mask, acc1, PRECISION, DOT_FP32)
        if COUNT > 2:
            acc2 = _shrink_step(xb, a2_ptr + a_offs, a_mask, acc2, PRECISION, DOT_FP32)
        x_ptrs += BLOCK_K * stride_xk
        a_offs += BLOCK_K * stride_ak
    return acc0, acc1, acc2


@triton.jit
def _shrink_step(xb, a_ptrs, a_mask, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    ab = tl.load(a_ptrs, mask=a_mask, other=0.0)
    if DOT_FP32:
        ab = ab.to(tl.float32)
    return tl.dot(xb, tl.trans(ab), acc, input_precision=PRECISION)


@triton.jit
def _slice_of_nblock(pid_n, nb0, nb1, NUM_SLICES: tl.constexpr):
    # N blocks of all slices are numbered one after another.
    slice_id = 0
    local_n = pid_n
    if NUM_SLICES > 1:
        if pid_n >= nb0:
            slice_id = 1
            local_n = pid_n - nb0
    if NUM_SLICES > 2:
        if pid_n >= nb0 + nb1:
            slice_id = 2
            local_n = pid_n - nb0 - nb1
    return slice_id, local_n


@triton.jit
def _expand_delta(
    b_ptr,
    xa,
    slot,
    offs_n,
    n_mask,
    stride_bs,
    R,
    stride_bn,
    stride_br,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N]: xa (the fp32 shrink) @ B[slot, offs_n].T"""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n[:, None] * stride_bn
        + offs_r[None, :] * stride_br
    )
    b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    # Round the fp32 shrink once to the weight dtype for the tensor-core product.
    xa = xa.to(b.dtype)
    if DOT_FP32:
        xa = xa.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(xa, tl.trans(b), input_precision=PRECISION)


@triton.jit
def _expand_tile(
    y_ptr,
    b_ptr,
    xa,
    tok,
    row_mask,
    slot,
    local_n,
    n_width,
    y_off,
    stride_bs,
    R,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ALIGN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """y[tok, y_off + local_n*BLOCK_N ...] += xa (fp32) @ B[slot, that N block].T"""
    if ALIGN > 1:
        # Per-slice ints come through a runtime pick, which loses the divisibility
        # Triton needs to emit 16-byte loads and stores. The host checked that
        # they are multiples of ALIGN, so these are identities that carry the fact.
        n_width = (n_width // ALIGN) * ALIGN
        y_off = (y_off // ALIGN) * ALIGN
        stride_bs = (stride_bs // ALIGN) * ALIGN
    offs_n = local_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_width
    delta = _expand_delta(
        b_ptr, xa, slot, offs_n, n_mask, stride_bs, R, stride_bn, stride_br,
        BLOCK_R, PRECISION, DOT_FP32,
    )
    y_ptrs = y_ptr + tok[:, None] * stride_ym + (y_off + offs_n)[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + delta).to(y_old.dtype), mask=y_mask)


@triton.jit
def _shrink_program(
    pid0,
    pid_m,
    x_ptr,
    ws_ptr,
    lock_ptr,
    flag_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    slot_count_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    num_tokens,
    num_slots,
    K,
    R,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    NUM_SLICES: tl.constexpr,
    PROGRAM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SIGNAL: tl.constexpr,
):
    """One K split of token tile pid_m, for one slice (PROGRAM_SLICES 1) or for all
    of them (PROGRAM_SLICES == NUM_SLICES: x is read once, not once per slice).
    With SIGNAL, the program that writes a slice's final result adds 1 to the
    tile's flag for it (one launch)."""
    groups = NUM_SLICES // PROGRAM_SLICES
    first = (pid0 % groups) * PROGRAM_SLICES
    split = pid0 // groups
    slot, pos0, rows_left = _slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, num_tokens, BLOCK_M, BLOCK_S, False
    )
    if slot < num_slots:
        if PROGRAM_SLICES == 1:
            a_first = _pick(first, a0_ptr, a1_ptr, a2_ptr)
            a_second = a_first
            a_third = a_first
        else:
            a_first = a0_ptr
            a_second = a1_ptr
            a_third = a2_ptr
        offs_m = tl.arange(0, BLOCK_M)
        row_mask = offs_m < rows_left
        tok = tl.load(sorted_ids_ptr + pos0 + offs_m, mask=row_mask, other=0).to(tl.int64)
        acc0, acc1, acc2 = _shrink_tile(
            x_ptr, a_first, a_second, a_third, tok, row_mask, slot,
            tl.multiple_of(split * k_per_split, BLOCK_K),
            k_per_split, K, R, stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
            PROGRAM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, PRECISION, DOT_FP32,
        )
        # Workspace layout: [1 + SPLIT_K, NUM_SLICES, num_tokens (sorted order), R]; block
        # 0 holds the final fp32 shrink, blocks 1.. the split-K partials.
        offs_r = tl.arange(0, BLOCK_R)
        ws_mask = row_mask[:, None] & (offs_r < R)[None, :]
        rows = first * num_tokens + pos0 + offs_m
        if SPLIT_K == 1:
            _store_slices(
                ws_ptr, rows, num_tokens, R, offs_r, ws_mask, acc0, acc1, acc2, PROGRAM_SLICES
            )
            if SIGNAL:
                tl.debug_barrier()
                tl.atomic_add(flag_ptr + pid_m, PROGRAM_SLICES, sem="release", scope="gpu")
        else:
            part = rows + (1 + split) * NUM_SLICES * num_tokens
            _store_slices(
                ws_ptr, part, num_tokens, R, offs_r, ws_mask, acc0, acc1, acc2, PROGRAM_SLICES
            )
            # The last split of this (tile, slices) to arrive sums the partials, so
            # the expand reads one fp32 block instead of SPLIT_K of them per N block.
            # The barrier puts every thread's stores before the release of the
            # counter; the counter goes back to 0 for the next call (or replay).
            tl.debug_barrier()
            lock = lock_ptr + pid_m * NUM_SLICES + first
            arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                for i in tl.static_range(PROGRAM_SLICES):
                    slice_rows = rows + i * num_tokens
                    total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for sp in tl.static_range(SPLIT_K):
                        part = slice_rows + (1 + sp) * NUM_SLICES * num_tokens
                        # .cg: read L2, never a stale L1 line.
                        total += tl.load(
                            ws_ptr + part[:, None] * R + offs_r[None, :],
                            mask=ws_mask,
                            other=0.0,
                            cache_modifier=".cg",
                        )
                    tl.store(ws_ptr + slice_rows[:, None] * R + offs_r[None, :], total,
                             mask=ws_mask)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
                if SIGNAL:
                    tl.debug_barrier()
                    tl.atomic_add(flag_ptr + pid_m, PROGRAM_SLICES, sem="release", scope="gpu")


@triton.jit
def _store_slices(ws_ptr, rows, slice_stride, R, offs_r, mask, acc0, acc1, acc2,
                  COUNT: tl.constexpr):
    # The first COUNT accumulators, to the workspace rows of consecutive slices.
    tl.store(ws_ptr + rows[:, None] * R + offs_r[None, :], acc0, mask=mask)
    if COUNT > 1:
        tl.store(ws_ptr + (rows + slice_stride)[:, None] * R + offs_r[None, :], acc1, mask=mask)
    if COUNT > 2:
        tl.store(ws_ptr + (rows + 2 * slice_stride)[:, None] * R + offs_r[None, :], acc2,
                 mask=mask)


@triton.jit
def _expand_program(
    pid_n,
    pid_m,
    y_ptr,
    ws_ptr,
    flag_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    slot_count_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    n0,
    n1,
    n2,
    yo0,
    yo1,
    yo2,
    sbs0,
    sbs1,
    sbs2,
    nb0,
    nb1,
    nb_total,
    num_tokens,
    num_slots,
    R,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    n_programs,
    flag_stride,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ALIGN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    N_ITERS: tl.constexpr,
    WAIT: tl.constexpr,
):
    """N_ITERS consecutive N blocks of token tile pid_m: the tile's slot lookup is
    paid once, and the unrolled blocks' loads overlap. With WAIT (one launch),
    first wait until the tile's flag says every slice's shrink is written; the
    last of the tile's n_programs to pass puts the flags back to 0."""
    slot, pos0, rows_left = _slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, num_tokens, BLOCK_M, BLOCK_S, False
    )
    if slot < num_slots:
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        row_mask = offs_m < rows_left
        tok = tl.load(sorted_ids_ptr + pos0 + offs_m, mask=row_mask, other=0).to(tl.int64)
        ws_mask = row_mask[:, None] & (offs_r < R)[None, :]
        if WAIT:
            ready = tl.atomic_add(flag_ptr + pid_m, 0, sem="acquire", scope="gpu")
            while ready < NUM_SLICES:
                ready = tl.atomic_add(flag_ptr + pid_m, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
        for i in tl.static_range(N_ITERS):
            n_block = pid_n * N_ITERS + i
            if n_block < nb_total:
                slice_id, local_n = _slice_of_nblock(n_block, nb0, nb1, NUM_SLICES)
                # The shrink result, already summed over K splits (fp32).
                ws_rows = slice_id * num_tokens + pos0 + offs_m
                ws_ptrs = ws_ptr + ws_rows[:, None] * R + offs_r[None, :]
                if WAIT:
                    # .cg: from L2, as another program of this launch just wrote it.
                    xa = tl.load(ws_ptrs, mask=ws_mask, other=0.0, cache_modifier=".cg")
                else:
                    xa = tl.load(ws_ptrs, mask=ws_mask, other=0.0)
                _expand_tile(
                    y_ptr,
                    _pick(slice_id, b0_ptr, b1_ptr, b2_ptr),
                    xa,
                    tok,
                    row_mask,
                    slot,
                    local_n,
                    _pick(slice_id, n0, n1, n2),
                    _pick(slice_id, yo0, yo1, yo2),
                    _pick(slice_id, sbs0, sbs1, sbs2),
                    R,
                    stride_bn,
                    stride_br,
                    stride_ym,
                    stride_yn,
                    BLOCK_N,
                    BLOCK_R,
                    ALIGN,
                    PRECISION,
                    DOT_FP32,
                )
        if WAIT:
            passed = tl.atomic_add(flag_ptr + flag_stride + pid_m, 1, sem="relaxed", scope="gpu")
            if passed == n_programs - 1:
                tl.atomic_xchg(flag_ptr + pid_m, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(flag_ptr + flag_stride + pid_m, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=_BATCH_INTS + ["k_per_split"])
def _lora_shrink_kernel(
    x_ptr, ws_ptr, lock_ptr, sorted_ids_ptr, slot_start_ptr, slot_count_ptr,
    a0_ptr, a1_ptr, a2_ptr, num_tokens, num_slots, K, R, k_per_split,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
    NUM_SLICES: tl.constexpr, PROGRAM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # Slice index varies fastest so the programs sharing one x tile run together
    # and the 2nd/3rd slice read it from L2.
    _shrink_program(
        tl.program_id(0), tl.program_id(1), x_ptr, ws_ptr, lock_ptr, lock_ptr,
        sorted_ids_ptr, slot_start_ptr, slot_count_ptr, a0_ptr, a1_ptr, a2_ptr,
        num_tokens, num_slots, K, R, k_per_split,
        stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
        NUM_SLICES, PROGRAM_SLICES, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_S, EVEN_K,
        PRECISION, DOT_FP32, False,
    )


@triton.jit(do_not_specialize=_PER_SLICE_INTS + _BATCH_INTS)
def _lora_expand_kernel(
    y_ptr, ws_ptr, sorted_ids_ptr, slot_start_ptr, slot_count_ptr,
    b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2,
    nb0, nb1, nb_total, num_tokens, num_slots, R,
    stride_bn, stride_br, stride_ym, stride_yn,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, N_ITERS: tl.constexpr,
):
    _expand_program(
        tl.program_id(0), tl.program_id(1), y_ptr, ws_ptr, ws_ptr,
        sorted_ids_ptr, slot_start_ptr, slot_count_ptr, b0_ptr, b1_ptr, b2_ptr,
        n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2, nb0, nb1, nb_total,
        num_tokens, num_slots, R, stride_bn, stride_br, stride_ym, stride_yn, 0, 0,
        NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_S, ALIGN, PRECISION, DOT_FP32, N_ITERS,
        False,
    )


@triton.jit(do_not_specialize=_PER_SLICE_INTS + _BATCH_INTS + ["k_per_split", "m_tiles"])
def _lora_one_launch_kernel(
    y_ptr, x_ptr, ws_ptr, lock_ptr, flag_ptr, sorted_ids_ptr, slot_start_ptr, slot_count_ptr,
    a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr,
    n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2, nb0, nb1, nb_total,
    num_tokens, num_slots, K, R, k_per_split, m_tiles, flag_stride,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
    stride_bn, stride_br, stride_ym, stride_yn,
    NUM_SLICES: tl.constexpr, PROGRAM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, EVEN_K: tl.constexpr, ALIGN: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, N_ITERS: tl.constexpr,
):
    # Shrink and expand in one grid: every shrink program has a lower index than
    # every expand program, and blocks start in index order, so an expand program
    # waiting on its tile's flag only waits for programs already running.
    pid = tl.program_id(0)
    per_tile = NUM_SLICES // PROGRAM_SLICES * SPLIT_K
    n_shrink = per_tile * m_tiles
    n_expand = (nb_total + N_ITERS - 1) // N_ITERS
    if pid < n_shrink:
        _shrink_program(
            pid % per_tile, pid // per_tile, x_ptr, ws_ptr, lock_ptr, flag_ptr,
            sorted_ids_ptr, slot_start_ptr, slot_count_ptr, a0_ptr, a1_ptr, a2_ptr,
            num_tokens, num_slots, K, R, k_per_split,
            stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
            NUM_SLICES, PROGRAM_SLICES, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_S, EVEN_K,
            PRECISION, DOT_FP32, True,
        )
    else:
        e = pid - n_shrink
        _expand_program(
            e % n_expand, e // n_expand, y_ptr, ws_ptr, flag_ptr,
            sorted_ids_ptr, slot_start_ptr, slot_count_ptr, b0_ptr, b1_ptr, b2_ptr,
            n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2, nb0, nb1, nb_total,
            num_tokens, num_slots, R, stride_bn, stride_br, stride_ym, stride_yn,
            n_expand, flag_stride,
            NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_S, ALIGN, PRECISION, DOT_FP32, N_ITERS,
            True,
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_token_tiles(num_tokens: int, block_m: int, num_groups: int) -> int:
    """Upper bound on the token tiles of a batch whose tokens fall in num_groups
    groups: each group adds at most one partial tile, and a tile holds at least
    one token. Programs past the real count exit at once."""
    return min(_cdiv(num_tokens, block_m) + num_groups, num_tokens)


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
) -> None:
    if len(lora_a) != len(lora_b) or not lora_a:
        raise ValueError("lora_a and lora_b need one entry per output slice")
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, K], [T, N]")
    a0 = lora_a[0]
    s, r, k = a0.shape
    if k != x.shape[1]:
        raise ValueError(f"lora_a K={k} != x K={x.shape[1]}")
    for a in lora_a:
        if a.shape != a0.shape or a.stride() != a0.stride():
            raise ValueError("all lora_a slices must share shape and strides")
    n_total = 0
    for b in lora_b:
        if b.dim() != 3 or b.shape[0] != s or b.shape[2] != r:
            raise ValueError(f"lora_b entry {tuple(b.shape)} does not match [S={s}, N, R={r}]")
        if b.stride()[1:] != lora_b[0].stride()[1:]:
            raise ValueError("all lora_b slices must share their N and R strides")
        n_total += b.shape[1]
    if n_total != y.shape[1]:
        raise ValueError(f"sum of slice widths {n_total} != y width {y.shape[1]}")
    for t in (*lora_a, *lora_b, y):
        if t.dtype != x.dtype:
            raise ValueError("x, y, lora_a and lora_b must share one dtype")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")


def workspace_numel(num_tokens: int, k: int, rank: int, num_slices: int) -> int:
    """fp32 elements of workspace one call with these shapes needs."""
    per_launch = min(num_slices, MAX_SLICES_PER_LAUNCH)
    cfg = shrink_config(num_tokens, k, rank, per_launch)
    return _ws_blocks(cfg["SPLIT_K"]) * per_launch * num_tokens * rank


def _ws_blocks(split_k: int) -> int:
    # The reduced shrink, plus one block per split when K is split.
    return 1 if split_k == 1 else 1 + split_k


def _shrink_args(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], meta: LoRAMetadata, cfg: dict[str, int],
    ws: torch.Tensor | None,
) -> dict:
    """The shrink kernel's arguments, by name (the one-launch kernel shares them)."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a[0].shape
    ns = len(lora_a)
    split_k, block_k = cfg["SPLIT_K"], cfg["BLOCK_K"]
    if ws is None:
        ws = meta.ensure_workspace(_ws_blocks(split_k) * ns * num_tokens * rank)
    dot_fp32, precision = _dot_mode(x.dtype)
    a_ptrs = list(lora_a) + [lora_a[0]] * (3 - ns)
    return dict(
        x_ptr=x, ws_ptr=ws, lock_ptr=meta.locks, sorted_ids_ptr=meta.sorted_ids,
        slot_start_ptr=meta.slot_start, slot_count_ptr=meta.slot_count,
        a0_ptr=a_ptrs[0], a1_ptr=a_ptrs[1], a2_ptr=a_ptrs[2],
        num_tokens=num_tokens, num_slots=num_slots, K=k, R=rank,
        # Round each split to whole K blocks so only the last one needs masking.
        k_per_split=_cdiv(_cdiv(k, split_k), block_k) * block_k,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_as=lora_a[0].stride(0),
        stride_ar=lora_a[0].stride(1), stride_ak=lora_a[0].stride(2),
        NUM_SLICES=ns, PROGRAM_SLICES=ns if cfg.get("FUSE_SLICES") else 1, SPLIT_K=split_k,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=block_k,
        BLOCK_R=rank_block(rank), BLOCK_S=_block_s(num_slots),
        EVEN_K=(k % (split_k * block_k) == 0), PRECISION=precision, DOT_FP32=dot_fp32,
    )


def _expand_args(
    y: torch.Tensor, lora_b: Sequence[torch.Tensor], y_offsets: Sequence[int],
    meta: LoRAMetadata, ws: torch.Tensor, cfg: dict[str, int],
) -> dict:
    """The expand kernel's arguments, by name."""
    num_slots, _, rank = lora_b[0].shape
    ns = len(lora_b)
    pad = 3 - ns
    widths = [b.shape[1] for b in lora_b] + [0] * pad
    offsets = list(y_offsets) + [0] * pad
    b_ptrs = list(lora_b) + [lora_b[0]] * pad
    b_strides = [b.stride(0) for b in lora_b] + [0] * pad
    nblocks = [_cdiv(w, cfg["BLOCK_N"]) for w in widths]
    dot_fp32, precision = _dot_mode(y.dtype)
    return dict(
        y_ptr=y, ws_ptr=ws, sorted_ids_ptr=meta.sorted_ids, slot_start_ptr=meta.slot_start,
        slot_count_ptr=meta.slot_count, b0_ptr=b_ptrs[0], b1_ptr=b_ptrs[1], b2_ptr=b_ptrs[2],
        n0=widths[0], n1=widths[1], n2=widths[2], yo0=offsets[0], yo1=offsets[1],
        yo2=offsets[2], sbs0=b_strides[0], sbs1=b_strides[1], sbs2=b_strides[2],
        nb0=nblocks[0], nb1=nblocks[1], nb_total=sum(nblocks),
        num_tokens=y.shape[0], num_slots=num_slots, R=rank,
        stride_bn=lora_b[0].stride(1), stride_br=lora_b[0].stride(2),
        stride_ym=y.stride(0), stride_yn=y.stride(1),
        NUM_SLICES=ns, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=rank_block(rank),
        BLOCK_S=_block_s(num_slots), ALIGN=_align(y, lora_b, y_offsets), PRECISION=precision,
        DOT_FP32=dot_fp32, N_ITERS=cfg.get("N_ITERS", 1),
    )


def _shrink_programs_per_tile(args: dict) -> int:
    return args["NUM_SLICES"] // args["PROGRAM_SLICES"] * args["SPLIT_K"]


def launch_shrink(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    cfg: dict[str, int],
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shrink for up to 3 slices: fp32 split-K partials into the workspace (returned)."""
    args = _shrink_args(x, lora_a, meta, cfg, ws)
    m_tiles = max_token_tiles(x.shape[0], cfg["BLOCK_M"], args["num_slots"])
    _lora_shrink_kernel[(_shrink_programs_per_tile(args), m_tiles)](
        **args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]
    )
    return args["ws_ptr"]


def launch_expand(
    y: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    y_offsets: Sequence[int],
    meta: LoRAMetadata,
    ws: torch.Tensor,
    cfg: dict[str, int],
) -> None:
    """Expand for up to 3 slices: y[:, off_i:off_i+N_i] += partial-sum @ B_i[slot].T."""
    args = _expand_args(y, lora_b, y_offsets, meta, ws, cfg)
    m_tiles = max_token_tiles(y.shape[0], cfg["BLOCK_M"], args["num_slots"])
    _lora_expand_kernel[(_cdiv(args["nb_total"], args["N_ITERS"]), m_tiles)](
        **args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]
    )


def launch_one(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    y_offsets: Sequence[int],
    meta: LoRAMetadata,
    scfg: dict[str, int],
    ecfg: dict[str, int],
) -> None:
    """Shrink and expand of up to 3 slices in one launch (configs of one BLOCK_M):
    the expand programs of a token tile start as soon as its shrink is written,
    and the launch gap between the two kernels goes away."""
    sargs = _shrink_args(x, lora_a, meta, scfg, None)
    eargs = _expand_args(y, lora_b, y_offsets, meta, sargs["ws_ptr"], ecfg)
    m_tiles = max_token_tiles(x.shape[0], scfg["BLOCK_M"], sargs["num_slots"])
    n_shrink = _shrink_programs_per_tile(sargs) * m_tiles
    n_expand = _cdiv(eargs["nb_total"], eargs["N_ITERS"]) * m_tiles
    # The two share their metadata, workspace, sizes and common block sizes.
    _lora_one_launch_kernel[(n_shrink + n_expand,)](
        **{**sargs, **eargs}, flag_ptr=meta.tile_flags, m_tiles=m_tiles,
        flag_stride=meta.max_tokens,
        # The expand's warps; the shrink's stages (only its K loop is pipelined).
        num_warps=ecfg["num_warps"], num_stages=scfg["num_stages"],
    )


def one_launch(num_tokens: int, scfg: dict[str, int], ecfg: dict[str, int]) -> bool:
    """Whether a call runs as one launch: at decode batch sizes, where the gap
    between two launches is a good part of the op, and when both configs tile
    tokens alike."""
    return ONE_LAUNCH_TOKENS[0] <= num_tokens <= ONE_LAUNCH_TOKENS[1] and (
        scfg["BLOCK_M"] == ecfg["BLOCK_M"]
    )


def _align(y: torch.Tensor, lora_b: Sequence[torch.Tensor], y_offsets: Sequence[int]) -> int:
    # 8 elements (16 bytes in 16-bit types) lets Triton vectorise y and B accesses.
    ints = [*y_offsets, *(b.shape[1] for b in lora_b), *(b.stride(0) for b in lora_b)]
    return 8 if all(v % 8 == 0 for v in ints) else 1


def _block_s(num_slots: int) -> int:
    return max(16, next_pow2(num_slots))


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    # Triton's CPU interpreter computes bf16 dots wrongly (seen with triton 3.9);
    # upcasting there is exact (bf16 products fit fp32). On a GPU: native dots,
    # and fp32 stays fp32 (no tf32 rounding) since fp32 LoRA is for exactness.
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "ieee"
    return False, ("ieee" if dtype == torch.float32 else "tf32")


def launch_configs(num_tokens: int, k: int, widths: Sequence[int], rank: int) -> tuple:
    """The launch configs of a call with these shapes, hashable. Calls that share them
    (and dtypes and strides) run the same compiled kernels: batch-size ints are not
    specialized."""
    step = MAX_SLICES_PER_LAUNCH
    ecfg = expand_config(num_tokens, sum(widths), rank)
    scfgs = [
        shrink_config(num_tokens, k, rank, len(widths[g : g + step]))
        for g in range(0, len(widths), step)
    ]
    shrink = tuple(tuple(sorted(c.items())) for c in scfgs)
    expand = tuple(sorted(ecfg.items()))
    # Per slice group: one launch, or shrink then expand.
    one = tuple(one_launch(num_tokens, c, ecfg) for c in scfgs)
    if len(widths) == 2 and widths[0] == widths[1]:
        # A gate/up pair: the model may run it through silu_and_mul_lora instead.
        silu = tuple(sorted(silu_config(num_tokens, widths[0], rank).items()))
        return shrink, expand, one, silu
    return shrink, expand, one


def prefers_one_launch(num_tokens: int, k: int, widths: Sequence[int], rank: int) -> bool:
    """Whether add_lora_linear runs a call of these shapes as one launch (then its
    shrink cannot run beside the base projection)."""
    if len(widths) > MAX_SLICES_PER_LAUNCH:
        return False
    scfg = shrink_config(num_tokens, k, rank, len(widths))
    return one_launch(num_tokens, scfg, expand_config(num_tokens, sum(widths), rank))


def lora_shrink(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], meta: LoRAMetadata
) -> torch.Tensor:
    """The first half of ``add_lora_linear`` for up to 3 slices: x @ A.T of every
    token's slot, in fp32, into ``meta``'s workspace (returned, for ``lora_expand``).
    It reads only x, so it may run beside the base projection (another stream)."""
    if len(lora_a) > MAX_SLICES_PER_LAUNCH:
        raise ValueError(f"lora_shrink takes up to {MAX_SLICES_PER_LAUNCH} slices")
    num_tokens, k = x.shape
    _check_meta(meta, num_tokens, lora_a[0].shape[0])
    cfg = shrink_config(num_tokens, k, lora_a[0].shape[1], len(lora_a))
    return launch_shrink(x, lora_a, meta, cfg)


def lora_expand(
    y: torch.Tensor, lora_b: Sequence[torch.Tensor], meta: LoRAMetadata, ws: torch.Tensor
) -> None:
    """The second half: y[t, slice i] += shrink @ B_i[slot].T, from ``lora_shrink``'s ws."""
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    cfg = expand_config(y.shape[0], sum(widths), lora_b[0].shape[2])
    launch_expand(y, lora_b, offsets, meta, ws, cfg)


def _check_meta(meta: LoRAMetadata, num_tokens: int, num_slots: int) -> None:
    if meta.num_tokens != num_tokens or meta.num_slots != num_slots:
        raise ValueError(
            f"metadata built for T={meta.num_tokens}, S={meta.num_slots}; "
            f"call has T={num_tokens}, S={num_slots}"
        )


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
    meta: LoRAMetadata | None = None,
) -> None:
    """In place: ``y[t, slice_i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T``, s = slot of t.

    ``meta`` (from ``build_lora_metadata`` / ``LoRAMetadata.update`` on the same
    ``token_slots``) makes the call allocation- and sync-free; when given,
    ``token_slots`` itself is not read again.
    """
    _check(y, x, lora_a, lora_b)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    num_slots, rank, _ = lora_a[0].shape
    if meta is None:
        meta = build_lora_metadata(token_slots, num_slots)
    _check_meta(meta, num_tokens, num_slots)
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    # One expand config over all slices (as launch_configs names it).
    ecfg = expand_config(num_tokens, sum(widths), rank)
    step = MAX_SLICES_PER_LAUNCH
    for g in range(0, len(lora_a), step):
        a_grp, b_grp, o_grp = lora_a[g : g + step], lora_b[g : g + step], offsets[g : g + step]
        scfg = shrink_config(num_tokens, x.shape[1], rank, len(a_grp))
        if one_launch(num_tokens, scfg, ecfg):
            launch_one(y, x, a_grp, b_grp, o_grp, meta, scfg, ecfg)
        else:
            ws = launch_shrink(x, a_grp, meta, scfg)
            launch_expand(y, b_grp, o_grp, meta, ws, ecfg)
