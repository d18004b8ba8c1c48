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
then two launches per call:

1. shrink: for each (slot, tile of up to BLOCK_M tokens, K split, slice),
   ``x_tile @ A[slot].T`` in fp32 into a workspace of split-K partials;
2. expand: for each (slot, token tile, BLOCK_N columns of y), sum the
   partials, cast to the weight dtype, multiply by ``B[slot].T`` and add to y.

Each tile reads its adapter's A/B once, so decode batches (one token per
request) and prefill batches share one code path; split-K gives decode enough
programs to use the whole GPU.

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

from .lora_config import expand_config, next_pow2, rank_block, shrink_config
from .lora_meta import LoRAMetadata, build_lora_metadata

# Slices handled by one launch pair; more slices use more launch pairs.
MAX_SLICES_PER_LAUNCH = 3


@triton.jit
def _slot_tile(
    pid_m,
    slot_start_ptr,
    slot_count_ptr,
    num_slots,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Map a token-tile index to (slot, first sorted position, rows left).

    Tiles are numbered slot by slot; every slot with c tokens owns cdiv(c, BLOCK_M)
    tiles. A program whose index is past the last tile gets slot == num_slots.
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
def _lora_shrink_kernel(
    x_ptr,
    ws_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Slice index varies fastest so the programs sharing one x tile run together
    # and the 2nd/3rd slice read it from L2.
    pid0 = tl.program_id(0)
    pid_m = tl.program_id(1)
    slice_id = pid0 % NUM_SLICES
    split = pid0 // NUM_SLICES
    slot, pos0, rows_left = _slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, BLOCK_M, BLOCK_S
    )
    if slot >= num_slots:
        return
    a_ptr = _pick(slice_id, a0_ptr, a1_ptr, a2_ptr)

    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < rows_left
    r_mask = offs_r < R
    tok = tl.load(sorted_ids_ptr + pos0 + offs_m, mask=row_mask, other=0).to(tl.int64)
    k_lo = split * k_per_split
    x_ptrs = x_ptr + tok[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    a_ptrs = (
        a_ptr
        + slot.to(tl.int64) * stride_as
        + offs_r[:, None] * stride_ar
        + (k_lo + offs_k)[None, :] * stride_ak
    )
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            xb = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            ab = tl.load(a_ptrs, mask=r_mask[:, None], other=0.0)
        else:
            k_mask = (k_lo + k + offs_k) < K
            xb = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            ab = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            xb = xb.to(tl.float32)
            ab = ab.to(tl.float32)
        acc = tl.dot(xb, tl.trans(ab), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    # Workspace layout: [SPLIT_K, NUM_SLICES, num_tokens (sorted order), R].
    ws_rows = (split * NUM_SLICES + slice_id) * num_tokens + pos0 + offs_m
    ws_ptrs = ws_ptr + ws_rows[:, None] * R + offs_r[None, :]
    tl.store(ws_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit(
    do_not_specialize=[
        "n0",
        "n1",
        "n2",
        "yo0",
        "yo1",
        "yo2",
        "sbs0",
        "sbs1",
        "sbs2",
        "nb0",
        "nb1",
    ]
)
def _lora_expand_kernel(
    y_ptr,
    ws_ptr,
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
    num_tokens,
    num_slots,
    R,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slot, pos0, rows_left = _slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, BLOCK_M, BLOCK_S
    )
    if slot >= num_slots:
        return
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
    b_ptr = _pick(slice_id, b0_ptr, b1_ptr, b2_ptr)
    n_width = _pick(slice_id, n0, n1, n2)
    y_off = _pick(slice_id, yo0, yo1, yo2)
    stride_bs = _pick(slice_id, sbs0, sbs1, sbs2)

    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = local_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_m < rows_left
    r_mask = offs_r < R
    n_mask = offs_n < n_width
    tok = tl.load(sorted_ids_ptr + pos0 + offs_m, mask=row_mask, other=0).to(tl.int64)

    # Sum the split-K partials of the shrink (fp32), then round once to the
    # weight dtype for the tensor-core product.
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    ws_rows = slice_id * num_tokens + pos0 + offs_m
    ws_mask = row_mask[:, None] & r_mask[None, :]
    for sp in range(SPLIT_K):
        ws_ptrs = ws_ptr + (ws_rows + sp * NUM_SLICES * num_tokens)[:, None] * R + offs_r[None, :]
        xa += tl.load(ws_ptrs, mask=ws_mask, other=0.0)

    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n[:, None] * stride_bn
        + offs_r[None, :] * stride_br
    )
    b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    xa = xa.to(b.dtype)
    if DOT_FP32:
        xa = xa.to(tl.float32)
        b = b.to(tl.float32)
    delta = tl.dot(xa, tl.trans(b), input_precision=PRECISION)

    y_ptrs = y_ptr + tok[:, None] * stride_ym + (y_off + offs_n)[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + delta).to(y_old.dtype), mask=y_mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    # fp32 LoRA is for exactness (tests, CPU-like numerics): no tf32 rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


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
    return cfg["SPLIT_K"] * per_launch * num_tokens * rank


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
    num_tokens, k = x.shape
    if num_tokens == 0:
        return
    num_slots, rank, _ = lora_a[0].shape
    if meta is None:
        meta = build_lora_metadata(token_slots, num_slots)
    elif meta.num_tokens != num_tokens or meta.num_slots != num_slots:
        raise ValueError(
            f"metadata built for T={meta.num_tokens}, S={meta.num_slots}; "
            f"call has T={num_tokens}, S={num_slots}"
        )
    block_r = rank_block(rank)
    block_s = max(16, next_pow2(num_slots))
    precision = _precision(x.dtype)
    # Triton's CPU interpreter computes bf16 dots wrongly (seen with triton 3.9);
    # upcasting there is exact (bf16 products fit fp32) and costs nothing on GPU.
    dot_fp32 = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if dot_fp32:
        precision = "ieee"
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]

    for g in range(0, len(lora_a), MAX_SLICES_PER_LAUNCH):
        a_grp = list(lora_a[g : g + MAX_SLICES_PER_LAUNCH])
        b_grp = list(lora_b[g : g + MAX_SLICES_PER_LAUNCH])
        w_grp = widths[g : g + MAX_SLICES_PER_LAUNCH]
        o_grp = offsets[g : g + MAX_SLICES_PER_LAUNCH]
        ns = len(a_grp)

        sc = shrink_config(num_tokens, k, rank, ns)
        split_k = sc["SPLIT_K"]
        block_k = sc["BLOCK_K"]
        k_per_split = _cdiv(_cdiv(k, split_k), block_k) * block_k
        ws = meta.ensure_workspace(split_k * ns * num_tokens * rank)
        # Upper bound on tiles: each slot adds at most one partial tile; a tile
        # holds at least one token.
        m_tiles = min(_cdiv(num_tokens, sc["BLOCK_M"]) + num_slots, num_tokens)
        a_ptrs = a_grp + [a_grp[0]] * (3 - ns)
        _lora_shrink_kernel[(ns * split_k, m_tiles)](
            x,
            ws,
            meta.sorted_ids,
            meta.slot_start,
            meta.slot_count,
            *a_ptrs,
            num_tokens,
            num_slots,
            k,
            rank,
            k_per_split,
            x.stride(0),
            x.stride(1),
            a_grp[0].stride(0),
            a_grp[0].stride(1),
            a_grp[0].stride(2),
            NUM_SLICES=ns,
            BLOCK_M=sc["BLOCK_M"],
            BLOCK_K=block_k,
            BLOCK_R=block_r,
            BLOCK_S=block_s,
            EVEN_K=(k % (split_k * block_k) == 0),
            PRECISION=precision,
            DOT_FP32=dot_fp32,
            num_warps=sc["num_warps"],
            num_stages=sc["num_stages"],
        )

        ec = expand_config(num_tokens, sum(widths), rank)
        block_n = ec["BLOCK_N"]
        nblocks = [_cdiv(w, block_n) for w in w_grp]
        m_tiles = min(_cdiv(num_tokens, ec["BLOCK_M"]) + num_slots, num_tokens)
        pad = 3 - ns
        _lora_expand_kernel[(sum(nblocks), m_tiles)](
            y,
            ws,
            meta.sorted_ids,
            meta.slot_start,
            meta.slot_count,
            *(b_grp + [b_grp[0]] * pad),
            *(w_grp + [0] * pad),
            *(o_grp + [0] * pad),
            *([b.stride(0) for b in b_grp] + [0] * pad),
            nblocks[0],
            nblocks[1] if ns > 1 else 0,
            num_tokens,
            num_slots,
            rank,
            b_grp[0].stride(1),
            b_grp[0].stride(2),
            y.stride(0),
            y.stride(1),
            NUM_SLICES=ns,
            SPLIT_K=split_k,
            BLOCK_M=ec["BLOCK_M"],
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            BLOCK_S=block_s,
            PRECISION=precision,
            DOT_FP32=dot_fp32,
            num_warps=ec["num_warps"],
            num_stages=ec["num_stages"],
        )
