"""Greedy sampling's argmax over the vocabulary, one launch (Triton).

torch's ``argmax`` over [B, V] spreads B rows over the GPU, and a two-pass
``max`` then ``argmax`` over vocabulary chunks is still two reduce kernels:
19.5 µs at 32 x 128256 bf16 on an H200, 0.4% of a decode step
(benchmarks/RESULTS.md). Here one program walks one row in BLOCK-wide strides:
each lane keeps its first maximum, and the row's answer is the smallest index
among the lanes that hold the row's maximum, so ties resolve to the first
index, as ``argmax`` does (NaN is not handled: logits never hold one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_begin

_BLOCK = 4096


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    base = x_ptr + row.to(tl.int64) * stride_x
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        # Strictly greater: a lane keeps the first of its equal maxima.
        take = x > best
        best = tl.where(take, x, best)
        where = tl.where(take, cols, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, n_cols), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] logits (any float dtype), int64 [B]."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        _argmax_kernel[(rows,)](logits, out, vocab, logits.stride(0), BLOCK=_BLOCK,
                                num_warps=8, **pdl_args(logits.device))
    return out
