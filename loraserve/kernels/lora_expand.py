"""The LoRA expand: ``y[t, slice i] += shrink[t] @ B_i[slot of t].T``.

A program owns one token tile of one slot and N_ITERS consecutive blocks of
BLOCK_N columns of y (the N blocks of all slices are numbered one after
another). It reads the fp32 shrink, rounds it once to the weight dtype,
multiplies by ``B[slot].T`` and adds the product to y in fp32 (one rounding).

``lora_expand`` is this half of ``add_lora_linear`` on its own, on the result of
``lora_shrink``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_common import BATCH_INTS, block_s, cdiv, dot_mode, max_token_tiles, pick, slot_tile
from .lora_config import expand_config, rank_block
from .lora_meta import LoRAMetadata

# The per-slice ints differ between layer shapes. Unspecialized, one compile per
# launch config serves every layer (ALIGN restores the divisibility vector
# accesses need).
PER_SLICE_INTS = [
    "n0", "n1", "n2", "yo0", "yo1", "yo2", "sbs0", "sbs1", "sbs2", "nb0", "nb1", "nb_total",
]


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
def expand_delta(
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
    delta = expand_delta(
        b_ptr, xa, slot, offs_n, n_mask, stride_bs, R, stride_bn, stride_br,
        BLOCK_R, PRECISION, DOT_FP32,
    )
    y_ptrs = y_ptr + tok[:, None] * stride_ym + (y_off + offs_n)[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + delta).to(y_old.dtype), mask=y_mask)


@triton.jit
def expand_program(
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
    slot, pos0, rows_left = slot_tile(
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
                    pick(slice_id, b0_ptr, b1_ptr, b2_ptr),
                    xa,
                    tok,
                    row_mask,
                    slot,
                    local_n,
                    pick(slice_id, n0, n1, n2),
                    pick(slice_id, yo0, yo1, yo2),
                    pick(slice_id, sbs0, sbs1, sbs2),
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


@triton.jit(do_not_specialize=PER_SLICE_INTS + BATCH_INTS)
def _lora_expand_kernel(
    y_ptr, ws_ptr, sorted_ids_ptr, slot_start_ptr, slot_count_ptr,
    b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2,
    nb0, nb1, nb_total, num_tokens, num_slots, R,
    stride_bn, stride_br, stride_ym, stride_yn,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, N_ITERS: tl.constexpr,
):
    expand_program(
        tl.program_id(0), tl.program_id(1), y_ptr, ws_ptr, ws_ptr,
        sorted_ids_ptr, slot_start_ptr, slot_count_ptr, b0_ptr, b1_ptr, b2_ptr,
        n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2, nb0, nb1, nb_total,
        num_tokens, num_slots, R, stride_bn, stride_br, stride_ym, stride_yn, 0, 0,
        NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_S, ALIGN, PRECISION, DOT_FP32, N_ITERS,
        False,
    )


def expand_args(
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
    nblocks = [cdiv(w, cfg["BLOCK_N"]) for w in widths]
    dot_fp32, precision = dot_mode(y.dtype)
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
        BLOCK_S=block_s(num_slots), ALIGN=_align(y, lora_b, y_offsets), PRECISION=precision,
        DOT_FP32=dot_fp32, N_ITERS=cfg.get("N_ITERS", 1),
    )


def launch_expand(
    y: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    y_offsets: Sequence[int],
    meta: LoRAMetadata,
    ws: torch.Tensor,
    cfg: dict[str, int],
) -> None:
    """Expand for up to 3 slices: y[:, off_i:off_i+N_i] += partial-sum @ B_i[slot].T."""
    args = expand_args(y, lora_b, y_offsets, meta, ws, cfg)
    m_tiles = max_token_tiles(y.shape[0], cfg["BLOCK_M"], args["num_slots"])
    _lora_expand_kernel[(cdiv(args["nb_total"], args["N_ITERS"]), m_tiles)](
        **args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]
    )


def _align(y: torch.Tensor, lora_b: Sequence[torch.Tensor], y_offsets: Sequence[int]) -> int:
    # 8 elements (16 bytes in 16-bit types) lets Triton vectorise y and B accesses.
    ints = [*y_offsets, *(b.shape[1] for b in lora_b), *(b.stride(0) for b in lora_b)]
    return 8 if all(v % 8 == 0 for v in ints) else 1


def lora_expand(
    y: torch.Tensor, lora_b: Sequence[torch.Tensor], meta: LoRAMetadata, ws: torch.Tensor
) -> None:
    """The second half: y[t, slice i] += shrink @ B_i[slot].T, from ``lora_shrink``'s ws."""
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    cfg = expand_config(y.shape[0], sum(widths), lora_b[0].shape[2])
    launch_expand(y, lora_b, offsets, meta, ws, cfg)

