"""The merged gate/up projection's LoRA expand, fused into SiLU-and-multiply.

``silu_and_mul_lora(gate_up, x, lora_a, lora_b, meta)`` returns what
``add_lora_linear(gate_up, x, lora_a, lora_b, ...)`` followed by
``silu_and_mul(gate_up)`` would, without writing the LoRA update into
``gate_up`` and reading it back: the expand's read-modify-write of the [T, 2I]
projection output is the largest memory traffic of a LoRA layer (2 x 470 MB per
layer for a prefill chunk of 8192 tokens on the Llama-3-8B shape).

The shrink is the usual one (``lora_shrink``, both slices in one launch). The
second kernel walks token tiles in slot order like the expand, plus tiles of
the tokens without an adapter, which get no update. Each program
adds the update to its gate and up blocks in fp32, rounds them to the
activation dtype (as the separate expand does), then applies SiLU-and-multiply
with the rounding of ``activation.silu_and_mul``; so the result is the one the
two separate ops give. ``gate_up`` itself is left as the base projection wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .lora_common import (
    BATCH_INTS,
    block_s,
    check_meta,
    check_operands,
    dot_mode,
    max_token_tiles,
    slot_tile,
)
from .lora_config import rank_block, silu_config
from .lora_expand import expand_delta
from .lora_meta import LoRAMetadata
from .lora_shrink import lora_shrink


@triton.jit(do_not_specialize=BATCH_INTS)
def _silu_and_mul_lora_kernel(
    y_ptr,
    out_ptr,
    ws_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    slot_count_ptr,
    bg_ptr,
    bu_ptr,
    width,
    num_blocks,
    num_tokens,
    num_slots,
    R,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ym,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    N_ITERS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slot, pos0, rows_left = slot_tile(
        pid_m, slot_start_ptr, slot_count_ptr, num_slots, num_tokens, BLOCK_M, BLOCK_S, True
    )
    if rows_left <= 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    row_mask = offs_m < rows_left
    tok = tl.load(sorted_ids_ptr + pos0 + offs_m, mask=row_mask, other=0).to(tl.int64)
    has_lora = slot < num_slots
    # The shrink of both slices (gate rows first, then up), summed over K splits.
    lora_rows = row_mask & (slot + 0 * offs_m < num_slots)
    ws_mask = lora_rows[:, None] & (offs_r < R)[None, :]
    ws_rows = pos0 + offs_m
    xa_gate = tl.load(ws_ptr + ws_rows[:, None] * R + offs_r[None, :], mask=ws_mask, other=0.0)
    xa_up = tl.load(
        ws_ptr + (num_tokens + ws_rows)[:, None] * R + offs_r[None, :], mask=ws_mask, other=0.0
    )
    for i in tl.static_range(N_ITERS):
        n_block = pid_n * N_ITERS + i
        if n_block < num_blocks:
            offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < width
            mask = row_mask[:, None] & n_mask[None, :]
            g_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :]
            gate = tl.load(g_ptrs, mask=mask, other=0.0)
            up = tl.load(g_ptrs + width, mask=mask, other=0.0)
            if has_lora:
                d_gate = expand_delta(
                    bg_ptr, xa_gate, slot, offs_n, n_mask, stride_bs, R, stride_bn, stride_br,
                    BLOCK_R, PRECISION, DOT_FP32,
                )
                d_up = expand_delta(
                    bu_ptr, xa_up, slot, offs_n, n_mask, stride_bs, R, stride_bn, stride_br,
                    BLOCK_R, PRECISION, DOT_FP32,
                )
                gate = (gate.to(tl.float32) + d_gate).to(gate.dtype)
                up = (up.to(tl.float32) + d_up).to(up.dtype)
            out = silu_mul(gate, up)
            tl.store(out_ptr + tok[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def silu_and_mul_lora(
    gate_up: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    ws: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate + LoRA update) * (up + LoRA update), [T, I], for gate_up = [T, 2I]
    (gate then up, the base projection of x) and two slices (gate, up) of LoRA
    weights. ``meta`` holds this step's token grouping, as for ``add_lora_linear``;
    ``ws``, when given, is ``lora_shrink(x, lora_a, meta)`` already done."""
    check_operands(gate_up, x, lora_a, lora_b)
    if len(lora_b) != 2 or lora_b[0].shape != lora_b[1].shape:
        raise ValueError("silu_and_mul_lora needs two slices (gate, up) of one width")
    if lora_b[0].stride() != lora_b[1].stride() or gate_up.stride(1) != 1:
        raise ValueError("gate and up B stacks must share strides; gate_up rows contiguous")
    num_tokens = x.shape[0]
    num_slots, width, rank = lora_b[0].shape
    check_meta(meta, num_tokens, num_slots)
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    if ws is None:
        ws = lora_shrink(x, lora_a, meta)
    launch_silu_and_mul(gate_up, out, lora_b, meta, ws, silu_config(num_tokens, width, rank))
    return out


def launch_silu_and_mul(
    gate_up: torch.Tensor,
    out: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    ws: torch.Tensor,
    cfg: dict[str, int],
) -> None:
    """The fused kernel, on the shrink result ``ws`` of both slices."""
    num_tokens = gate_up.shape[0]
    num_slots, width, rank = lora_b[0].shape
    block_n, n_iters = cfg["BLOCK_N"], cfg.get("N_ITERS", 1)
    num_blocks = triton.cdiv(width, block_n)
    # The tokens without an adapter are one more group of tiles.
    m_tiles = max_token_tiles(num_tokens, cfg["BLOCK_M"], num_slots + 1)
    dot_fp32, precision = dot_mode(gate_up.dtype)
    _silu_and_mul_lora_kernel[(triton.cdiv(num_blocks, n_iters), m_tiles)](
        gate_up,
        out,
        ws,
        meta.sorted_ids,
        meta.slot_start,
        meta.slot_count,
        lora_b[0],
        lora_b[1],
        width,
        num_blocks,
        num_tokens,
        num_slots,
        rank,
        lora_b[0].stride(0),
        lora_b[0].stride(1),
        lora_b[0].stride(2),
        gate_up.stride(0),
        out.stride(0),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=block_n,
        BLOCK_R=rank_block(rank),
        BLOCK_S=block_s(num_slots),
        PRECISION=precision,
        DOT_FP32=dot_fp32,
        N_ITERS=n_iters,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
