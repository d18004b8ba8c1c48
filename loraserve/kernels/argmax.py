"""Greedy sampling's argmax over the vocabulary, one launch (Triton).

torch's ``argmax`` over [B, V] spreads B rows over the GPU, and a two-pass
``max`` then ``argmax`` over vocabulary chunks is still two reduce kernels:
19.5 µs at 32 x 128256 bf16 on an H200, 0.4% of a decode step; one program a
row walking it in a loop waits on every load in turn, 30 µs
(benchmarks/RESULTS.md). Here a row is cut into up to MAX_CHUNKS chunks of
BLOCK columns, a program each, loaded at once. A program takes its chunk's
maximum and the first index holding it (each lane keeps its first maximum; the
smallest index among the lanes holding the chunk's maximum wins), stores them,
and counts itself in on the row's counter; the chunk that completes the count
does the same over the row's chunks, so ties resolve to the first index, as
``argmax`` does, whatever order the chunks finish in. NaN is not handled:
logits never hold one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counters import counter_buffer
from .pdl import pdl_args, pdl_begin

_BLOCK = 4096
MAX_CHUNKS = 64
# Row counters (loraserve/kernels/counters.py); more rows than this take one chunk a row.
_MAX_ROWS = 4096


@triton.jit
def _first_max(values, index, n_cols):
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, index, n_cols), axis=0)


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, part_val_ptr, part_idx_ptr, lock_ptr, n_cols, stride_x, cols_per_chunk,
    CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    base = x_ptr + row.to(tl.int64) * stride_x
    lo = chunk * cols_per_chunk
    hi = tl.minimum(lo + cols_per_chunk, n_cols)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        # Strictly greater: a lane keeps the first of its equal maxima.
        take = x > best
        best = tl.where(take, x, best)
        where = tl.where(take, cols, where)
    top, first = _first_max(best, where, n_cols)
    if CHUNKS == 1:
        tl.store(out_ptr + row, first.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * CHUNKS + chunk, top)
        tl.store(part_idx_ptr + row * CHUNKS + chunk, first)
        # The barrier puts every thread's stores before the counter's release.
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_P2)
            ok = c < CHUNKS
            # .cg: read L2, never a stale L1 line.
            vals = tl.load(part_val_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"),
                           cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * CHUNKS + c, mask=ok, other=n_cols,
                           cache_modifier=".cg")
            top, first = _first_max(vals, idxs, n_cols)
            tl.store(out_ptr + row, first.to(tl.int64))
            tl.atomic_xchg(lock_ptr + row, 0, sem="relaxed", scope="gpu")


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] logits (any float dtype), int64 [B], into
    ``out`` if given."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.long and out.stride(0) == 1
    if rows == 0:
        return out
    chunks = min(MAX_CHUNKS, triton.cdiv(vocab, _BLOCK)) if rows <= _MAX_ROWS else 1
    cols_per_chunk = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK) * _BLOCK
    chunks = triton.cdiv(vocab, cols_per_chunk)
    if chunks > 1:
        part_val = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
        locks = counter_buffer("argmax", logits.device, _MAX_ROWS)
    else:
        part_val = part_idx = locks = out  # unused
    _argmax_kernel[(rows, chunks)](
        logits, out, part_val, part_idx, locks, vocab, logits.stride(0), cols_per_chunk,
        CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=_BLOCK, num_warps=8,
        **pdl_args(logits.device),
    )
    return out
