"""The LoRA shrink: ``x[t] @ A[slot of t].T`` in fp32, per output slice.

A program owns one token tile of one slot and one of SPLIT_K ranges of K, for
one slice or (``FUSE_SLICES``) for every slice of its tile, loading each x block
once for all of them. With split-K every split writes a partial; the last split
to arrive (an atomic counter per tile and slice, reset by that program) sums
them in a fixed order, so results are deterministic and the expand reads one
fp32 block per tile.

``lora_shrink`` is this half of ``add_lora_linear`` on its own, so it can run on
another stream beside the base projection, which also only reads x
(``loraserve.lora.punica_triton``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_common import (
    BATCH_INTS,
    MAX_SLICES_PER_LAUNCH,
    block_s,
    cdiv,
    check_meta,
    dot_mode,
    max_token_tiles,
    pick,
    slot_tile,
)
from .lora_config import rank_block, shrink_config
from .lora_meta import LoRAMetadata


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
def shrink_program(
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
    slot, pos0, rows_left = slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, num_tokens, BLOCK_M, BLOCK_S, False
    )
    if slot < num_slots:
        if PROGRAM_SLICES == 1:
            a_first = pick(first, a0_ptr, a1_ptr, a2_ptr)
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


@triton.jit(do_not_specialize=BATCH_INTS + ["k_per_split"])
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
    shrink_program(
        tl.program_id(0), tl.program_id(1), x_ptr, ws_ptr, lock_ptr, lock_ptr,
        sorted_ids_ptr, slot_start_ptr, slot_count_ptr, a0_ptr, a1_ptr, a2_ptr,
        num_tokens, num_slots, K, R, k_per_split,
        stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
        NUM_SLICES, PROGRAM_SLICES, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_S, EVEN_K,
        PRECISION, DOT_FP32, False,
    )


def workspace_numel(num_tokens: int, k: int, rank: int, num_slices: int) -> int:
    """fp32 elements of workspace one call with these shapes needs."""
    per_launch = min(num_slices, MAX_SLICES_PER_LAUNCH)
    cfg = shrink_config(num_tokens, k, rank, per_launch)
    return ws_blocks(cfg["SPLIT_K"]) * per_launch * num_tokens * rank


def ws_blocks(split_k: int) -> int:
    # The reduced shrink, plus one block per split when K is split.
    return 1 if split_k == 1 else 1 + split_k


def shrink_args(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], meta: LoRAMetadata, cfg: dict[str, int],
    ws: torch.Tensor | None,
) -> dict:
    """The shrink kernel's arguments, by name (the one-launch kernel shares them)."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a[0].shape
    ns = len(lora_a)
    split_k, block_k = cfg["SPLIT_K"], cfg["BLOCK_K"]
    if ws is None:
        ws = meta.ensure_workspace(ws_blocks(split_k) * ns * num_tokens * rank)
    dot_fp32, precision = dot_mode(x.dtype)
    a_ptrs = list(lora_a) + [lora_a[0]] * (3 - ns)
    return dict(
        x_ptr=x, ws_ptr=ws, lock_ptr=meta.locks, sorted_ids_ptr=meta.sorted_ids,
        slot_start_ptr=meta.slot_start, slot_count_ptr=meta.slot_count,
        a0_ptr=a_ptrs[0], a1_ptr=a_ptrs[1], a2_ptr=a_ptrs[2],
        num_tokens=num_tokens, num_slots=num_slots, K=k, R=rank,
        # Round each split to whole K blocks so only the last one needs masking.
        k_per_split=cdiv(cdiv(k, split_k), block_k) * block_k,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_as=lora_a[0].stride(0),
        stride_ar=lora_a[0].stride(1), stride_ak=lora_a[0].stride(2),
        NUM_SLICES=ns, PROGRAM_SLICES=ns if cfg.get("FUSE_SLICES") else 1, SPLIT_K=split_k,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=block_k,
        BLOCK_R=rank_block(rank), BLOCK_S=block_s(num_slots),
        EVEN_K=(k % (split_k * block_k) == 0), PRECISION=precision, DOT_FP32=dot_fp32,
    )


def shrink_programs_per_tile(args: dict) -> int:
    return args["NUM_SLICES"] // args["PROGRAM_SLICES"] * args["SPLIT_K"]


def launch_shrink(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    cfg: dict[str, int],
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shrink for up to 3 slices: fp32 split-K partials into the workspace (returned)."""
    args = shrink_args(x, lora_a, meta, cfg, ws)
    m_tiles = max_token_tiles(x.shape[0], cfg["BLOCK_M"], args["num_slots"])
    _lora_shrink_kernel[(shrink_programs_per_tile(args), m_tiles)](
        **args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]
    )
    return args["ws_ptr"]


def lora_shrink(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], meta: LoRAMetadata
) -> torch.Tensor:
    """The first half of ``add_lora_linear`` for up to 3 slices: x @ A.T of every
    token's slot, in fp32, into ``meta``'s workspace (returned, for ``lora_expand``).
    It reads only x, so it may run beside the base projection (another stream)."""
    if len(lora_a) > MAX_SLICES_PER_LAUNCH:
        raise ValueError(f"lora_shrink takes up to {MAX_SLICES_PER_LAUNCH} slices")
    num_tokens, k = x.shape
    check_meta(meta, num_tokens, lora_a[0].shape[0])
    cfg = shrink_config(num_tokens, k, lora_a[0].shape[1], len(lora_a))
    return launch_shrink(x, lora_a, meta, cfg)

