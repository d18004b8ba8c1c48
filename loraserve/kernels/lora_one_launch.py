"""Shrink and expand of one LoRA call in a single launch, for decode batch sizes.

The shrink programs come first in the grid, and each expand program waits on a
per-tile flag that the programs writing its tile's final shrink raise. That
saves the gap between two dependent launches, a good part of the op at these
sizes. It relies on a grid's blocks starting in index order (so a waiting
program only waits for programs already running), which is how NVIDIA GPUs
dispatch them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_common import BATCH_INTS, cdiv, max_token_tiles
from .lora_expand import PER_SLICE_INTS, expand_args, expand_program
from .lora_meta import LoRAMetadata
from .lora_shrink import shrink_args, shrink_program, shrink_programs_per_tile


@triton.jit(do_not_specialize=PER_SLICE_INTS + BATCH_INTS + ["k_per_split", "m_tiles"])
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
        shrink_program(
            pid % per_tile, pid // per_tile, x_ptr, ws_ptr, lock_ptr, flag_ptr,
            sorted_ids_ptr, slot_start_ptr, slot_count_ptr, a0_ptr, a1_ptr, a2_ptr,
            num_tokens, num_slots, K, R, k_per_split,
            stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
            NUM_SLICES, PROGRAM_SLICES, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_S, EVEN_K,
            PRECISION, DOT_FP32, True,
        )
    else:
        e = pid - n_shrink
        expand_program(
            e % n_expand, e // n_expand, y_ptr, ws_ptr, flag_ptr,
            sorted_ids_ptr, slot_start_ptr, slot_count_ptr, b0_ptr, b1_ptr, b2_ptr,
            n0, n1, n2, yo0, yo1, yo2, sbs0, sbs1, sbs2, nb0, nb1, nb_total,
            num_tokens, num_slots, R, stride_bn, stride_br, stride_ym, stride_yn,
            n_expand, flag_stride,
            NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_S, ALIGN, PRECISION, DOT_FP32, N_ITERS,
            True,
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
    sargs = shrink_args(x, lora_a, meta, scfg, None)
    eargs = expand_args(y, lora_b, y_offsets, meta, sargs["ws_ptr"], ecfg)
    m_tiles = max_token_tiles(x.shape[0], scfg["BLOCK_M"], sargs["num_slots"])
    n_shrink = shrink_programs_per_tile(sargs) * m_tiles
    n_expand = cdiv(eargs["nb_total"], eargs["N_ITERS"]) * m_tiles
    # The two share their metadata, workspace, sizes and common block sizes.
    _lora_one_launch_kernel[(n_shrink + n_expand,)](
        **{**sargs, **eargs}, flag_ptr=meta.tile_flags, m_tiles=m_tiles,
        flag_stride=meta.max_tokens,
        # The expand's warps; the shrink's stages (only its K loop is pipelined).
        num_warps=ecfg["num_warps"], num_stages=scfg["num_stages"],
    )
