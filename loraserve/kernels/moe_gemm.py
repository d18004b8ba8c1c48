"""Grouped GEMM over the groups of a MoE step: every expert (or, for MoE LoRA,
every (slot, expert) pair) in one launch.

A MoE step has P = T * top_k rows, row p being token p // top_k sent to the
expert ``topk_ids.flatten()[p]``. ``align_rows`` sorts the rows by group and
pads each group to a multiple of BLOCK_M, so that every block of BLOCK_M sorted
rows belongs to one group: ``sorted_rows`` holds the row ids (P marks padding)
and ``block_group`` each block's group (-1: a block past the last one in use).
Everything is computed on the device without reading a count back, so a decode
step stays capturable in a CUDA graph: the grid is sized for the worst case and
unused blocks return at once.

``grouped_gemm`` computes, for each row p of group g in a block,

    out[p] (+)= inp[p // in_div] @ weight[g].T

where ``weight`` is [G, N, K]: the experts' gate/up or down projections, or a
LoRA A [S * E, R, K] / B [S * E, N, R] stack seen as one group per (slot, expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .lora_common import dot_mode


@dataclass
class AlignedRows:
    """Rows sorted by group, each group padded to whole blocks."""

    sorted_rows: torch.Tensor  # [num_blocks * block_m] int32; num_rows marks padding
    block_group: torch.Tensor  # [num_blocks] int32; -1: unused block
    num_rows: int
    block_m: int


def align_rows(group_of_row: torch.Tensor, num_groups: int, block_m: int) -> AlignedRows:
    """Sort rows by group (-1: a row that no group takes) into blocks of block_m."""
    rows = group_of_row.numel()
    device = group_of_row.device
    # At most one partly filled block per group that has a row.
    num_blocks = triton.cdiv(rows, block_m) + min(num_groups, rows)
    key = torch.where(group_of_row < 0, num_groups, group_of_row).to(torch.int64).flatten()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    row_start = torch.cumsum(counts, 0) - counts
    blocks = (counts[:num_groups] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    sorted_key = key[order]
    rank = torch.arange(rows, device=device) - row_start[sorted_key]
    first_block = (block_end - blocks)[sorted_key.clamp(max=num_groups - 1)]
    trash = num_blocks * block_m  # where rows of no group go
    dest = torch.where(sorted_key < num_groups, first_block * block_m + rank, trash)
    sorted_rows = torch.full((trash + 1,), rows, dtype=torch.int32, device=device)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_ids = torch.arange(num_blocks, device=device)
    group = torch.searchsorted(block_end, block_ids, right=True)
    block_group = torch.where(group < num_groups, group, -1).to(torch.int32)
    return AlignedRows(sorted_rows[:trash], block_group, rows, block_m)


# The row count changes with every batch: not a specialisation (one compile).
@triton.jit(do_not_specialize=["num_rows"])
def _grouped_gemm_kernel(
    inp_ptr, w_ptr, out_ptr, sorted_rows_ptr, block_group_ptr,
    num_rows, N, K, in_div,
    stride_im, stride_ik, stride_wg, stride_wn, stride_wk, stride_om, stride_on,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    group = tl.load(block_group_ptr + pid_m)
    if group < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_mask = rows < num_rows
    in_rows = tl.where(row_mask, rows // in_div, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + group.to(tl.int64) * stride_wg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(inp_ptr + in_rows[:, None] * stride_im + offs_k[None, :] * stride_ik,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
    out_ptrs = (out_ptr + rows.to(tl.int64)[:, None] * stride_om
                + offs_n[None, :] * stride_on)
    mask = row_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks_nk(n: int, k: int, num_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [N, K] weight."""
    block_n = 16 if n <= 16 else (32 if n <= 32 else (64 if num_rows <= 512 else 128))
    block_k = 16 if k <= 16 else (32 if k <= 32 else 64)
    return block_n, block_k, (4 if block_n <= 64 else 8), 3


def grouped_gemm(
    inp: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    aligned: AlignedRows,
    in_div: int = 1,
    accumulate: bool = False,
) -> torch.Tensor:
    """out[p] (+)= inp[p // in_div] @ weight[group of p].T for every aligned row p;
    rows of no group are left as they were."""
    _, n, k = weight.shape
    assert inp.shape[1] == k and out.shape[1] == n and out.shape[0] == aligned.num_rows
    block_n, block_k, warps, stages = _blocks_nk(n, k, aligned.num_rows)
    upcast, precision = dot_mode(weight.dtype)
    grid = (aligned.block_group.numel(), triton.cdiv(n, block_n))
    if grid[0]:
        _grouped_gemm_kernel[grid](
            inp, weight, out, aligned.sorted_rows, aligned.block_group,
            aligned.num_rows, n, k, in_div,
            inp.stride(0), inp.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
            out.stride(0), out.stride(1),
            ACCUMULATE=accumulate, UPCAST=upcast, PRECISION=precision,
            BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )
    return out


def block_m_for(num_rows: int, num_groups: int) -> int:
    """Rows per block: small where the groups get few rows each (decode)."""
    per_group = num_rows / max(1, min(num_groups, num_rows))
    return 16 if per_group <= 16 else (32 if per_group <= 64 else 64)
