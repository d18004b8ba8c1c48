"""y = x @ W.T (+ bias) for the few-token batches of decode (Triton).

A decode step reads every weight of the model once for a handful of tokens, so
a linear layer there is a stream of weight bytes and its speed is how many of
them every SM keeps in flight. cuBLAS splits K for the narrow layers and sums
the partials in a second kernel (0.13 ms a step at batch 32 on the Llama-3-8B
shape, benchmarks/RESULTS.md); here the last K split of a column tile to finish
sums them, in the same launch.

API
---
``dense_linear(x, weight, bias=None)``: x [M, K], weight [N, K] (nn.Linear's
layout), bias [N] or None -> [M, N] in x's dtype. For M up to ``MAX_TOKENS``;
``use_kernel(M, N, K)`` says whether it beats cuBLAS there (tuned table).

How it runs
-----------
A program owns BLOCK_N output columns and one of SPLIT_K ranges of K. It
computes the [BLOCK_N, BLOCK_M] tile W @ x.T, so the wide weight tile is the
dot's first operand and the few tokens (BLOCK_M >= 16, padded) its second.
With SPLIT_K > 1 every split writes its fp32 partial to a workspace and adds 1
to its column tile's counter; the split that brings the counter to SPLIT_K sums
the partials in split order (the result does not depend on who finished last),
writes y and puts the counter back to 0 for the next call or graph replay.
With PDL (loraserve/kernels/pdl.py) a program first prefetches the start of its weight
rows into L2, then waits for the previous kernel.

CUDA graphs: the counters live in one zeroed buffer per device
(loraserve/kernels/counters.py), made on the first call (the eager warm-up before a
capture); the workspace comes from the caching allocator, so from the graph's
pool when captured.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .counters import counter_buffer
from .lora_config import dense_config, dense_tuned, has_dense_table, token_block
from .pdl import gdc_launch_dependents, gdc_wait, l2_prefetch, pdl_args

# Above this many tokens a step is no longer a pure weight stream: cuBLAS.
MAX_TOKENS = 64
# With PDL, the columns of each weight row a program prefetches into L2 before
# the previous kernel ends: one pipeline stage's worth. More delays the previous
# kernel's own reads (a batch-32 step on the H200: 0 / 128 / 256 / 512 / 1024
# columns took 4.850 / 4.817 / 4.824 / 4.864 / 4.92 ms, benchmarks/RESULTS.md).
PREFETCH_COLUMNS = 128
# A table entry's "PREFETCH" overrides it for its shape.
# Counters for this many column tiles (N / BLOCK_N of any split launch).
_MAX_LOCKS = 8192


@triton.jit
def _dense_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    # k_per_split is a whole number of K blocks, so every split starts aligned.
    k_lo = tl.multiple_of(split * k_per_split, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
        if PREFETCH_K > 0:
            # The weights are no kernel's output: start pulling the first
            # PREFETCH_K columns of this program's rows into L2 while the previous
            # kernel finishes, one prefetch per 128-byte line.
            line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
            cols = k_lo + tl.arange(0, PREFETCH_K // line) * line
            pf_ok = n_ok[:, None] & (cols < K)[None, :]
            pf_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + cols[None, :]
            l2_prefetch(tl.where(pf_ok, pf_ptrs, w_ptr))
            if SILU_MUL:
                l2_prefetch(tl.where(pf_ok, pf_ptrs + N * stride_wn, w_ptr))
        gdc_wait()
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # With SILU_MUL N is I, and the program also owns the up rows N below its gate rows.
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        k_ok = (k_lo + k + offs_k) < K
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = _weight_tile(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        if SILU_MUL:
            w_up = _weight_tile(w_ptrs + N * stride_wn, n_ok, k_ok, EVEN_K, EVEN_N)
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    if SPLIT_K == 1:
        _dense_epilogue(acc, acc_up, b_ptr, y_ptr, offs_n, offs_m, n_ok, m_ok, N,
                        stride_ym, SILU_MUL, HAS_BIAS)
    else:
        # Workspace [SPLIT_K, column tiles, 1 or 2 (gate, up), BLOCK_N, BLOCK_M], fp32.
        parts: tl.constexpr = 2 if SILU_MUL else 1
        tile = BLOCK_N * BLOCK_M
        offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        n_tiles = tl.num_programs(0)
        mine = ws_ptr + (split * n_tiles + pid_n) * parts * tile + offs_tile
        tl.store(mine, acc)
        if SILU_MUL:
            tl.store(mine + tile, acc_up)
        # The barrier puts every thread's stores before the counter's release.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            total_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                part = ws_ptr + (sp * n_tiles + pid_n) * parts * tile + offs_tile
                # .cg: read L2, never a stale L1 line.
                total += tl.load(part, cache_modifier=".cg")
                if SILU_MUL:
                    total_up += tl.load(part + tile, cache_modifier=".cg")
            _dense_epilogue(total, total_up, b_ptr, y_ptr, offs_n, offs_m, n_ok, m_ok,
                            N, stride_ym, SILU_MUL, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _weight_tile(ptrs, n_ok, k_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    # Masks only where the sizes need them: unmasked loads vectorize best.
    if EVEN_K:
        if EVEN_N:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _dense_epilogue(acc, acc_up, b_ptr, y_ptr, offs_n, offs_m, n_ok, m_ok, N,
                    stride_ym, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Bias, then y (or silu(gate) * up, each rounded first as the unfused layers
    round their outputs) for one [BLOCK_N, BLOCK_M] tile of y.T."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = acc.to(y_ptr.dtype.element_ty)
    if SILU_MUL:
        if HAS_BIAS:
            bias_up = tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0)
            acc_up += bias_up.to(tl.float32)[:, None]
        out = silu_mul(out, acc_up.to(y_ptr.dtype.element_ty))
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])


def use_kernel(num_tokens: int, n: int, k: int) -> bool:
    """Whether y = x @ W.T of these sizes should run here rather than on cuBLAS:
    at most MAX_TOKENS tokens, on a GPU whose table has a decode GEMM section
    (untuned GPUs keep cuBLAS), unless its entry for these sizes says cuBLAS won.
    Sizes the table lacks run the default config."""
    if num_tokens > MAX_TOKENS or not has_dense_table():
        return False
    tuned = dense_tuned(num_tokens, n, k)
    return not (tuned and tuned.get("CUBLAS"))


def _lock_buffer(device: torch.device) -> torch.Tensor:
    return counter_buffer("dense_linear", device, _MAX_LOCKS)


def use_fused_silu_and_mul(num_tokens: int) -> bool:
    """Whether a merged gate/up layer should run ``dense_linear(..., silu_mul=True)``:
    decode sizes on a GPU with a decode GEMM section (one kernel instead of the
    GEMM and the activation)."""
    return num_tokens <= MAX_TOKENS and has_dense_table()


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x @ weight.T (+ bias); ``config`` overrides the tuned/default one (tuning, tests).

    ``silu_mul``: weight is a merged gate/up [2I, K]; returns silu(gate) * up [M, I],
    each half rounded to x's dtype first, as ``silu_and_mul(dense_linear(x, weight))``
    does. A program then owns BLOCK_N / 2 gate rows and the matching up rows, so
    the config (the merged layer's) keeps its bytes per program."""
    num_tokens, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert not silu_mul or weight.shape[0] == 2 * n
    assert num_tokens <= MAX_TOKENS, f"{num_tokens} tokens: use a GEMM made for them"
    y = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    cfg = config or dense_config(num_tokens, weight.shape[0], k, silu_mul)
    block_m, block_n, block_k = token_block(num_tokens), cfg["BLOCK_N"], cfg["BLOCK_K"]
    if silu_mul:
        block_n = max(16, block_n // 2)
    split = cfg["SPLIT_K"]
    prefetch = cfg.get("PREFETCH", PREFETCH_COLUMNS)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    n_tiles = triton.cdiv(n, block_n)
    if split > 1:
        assert n_tiles <= _MAX_LOCKS
        parts = 2 if silu_mul else 1
        ws = torch.empty(split * n_tiles * parts * block_n * block_m, dtype=torch.float32,
                         device=x.device)
        locks = _lock_buffer(x.device)
    else:
        ws = locks = y  # unused
    _dense_kernel[(n_tiles, split)](
        x, weight, bias if bias is not None else y, y, ws, locks,
        num_tokens, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split, EVEN_K=k % (split * block_k) == 0,
        EVEN_N=n % block_n == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH_K=prefetch and max(64, min(prefetch, triton.next_power_of_2(k_per_split))),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args(x.device),
    )
    return y
