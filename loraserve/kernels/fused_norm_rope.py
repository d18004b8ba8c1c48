"""Fused elementwise kernels for the decoder: (residual add +) RMSNorm, and rotary
embedding of q and k in place.

In eager torch each of these is 8 to 16 small kernels per layer; inside a decode
CUDA graph every one is still a node with its own launch gap, and together they
cost as much as the layer's matmuls at small batches. One program per token
row here. Results match the torch formulas of loraserve.model (and so
transformers): the sum is rounded to the activation dtype before the norm,
the norm runs in fp32, and the weight multiplies the normalised value after it
is rounded back to the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_begin


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr,
    stride_x, stride_res, stride_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as `residual + hidden` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(w.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [T, H] (rows contiguous). With `residual`, first
    residual += x (in place) and normalise that sum."""
    assert x.dim() == 2 and x.stride(1) == 1
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    block = triton.next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, out, weight,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        x.shape[1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, **pdl_args(x.device),
    )
    return out


@triton.jit
def rotate_half(x, x_half, cos, sin, sign):
    """The rotate-half rotary of x (a head, or one half of it), in fp32 and rounded
    to x's dtype: x * cos + sign * x_half * sin, where x_half holds each element's
    partner D/2 away and sign is -1 where the partner is in the second half, +1
    where it is in the first. The rotary kernel here and decode attention
    (paged_attention's new_kv) both rotate with it."""
    rotated = x.to(tl.float32) * cos + (sign * x_half.to(tl.float32)) * sin
    return rotated.to(x.dtype)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, HEADS_P2: tl.constexpr,
    WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF_P2)
    dmask = d < HALF
    cos1 = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0)
    # The tables repeat their halves (cat(freqs, freqs)); read both to stay exact.
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_cos + HALF + d, mask=dmask, other=0.0)
    h = tl.arange(0, HEADS_P2)
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + token * stride_qt
            stride_h = stride_qh
            heads = num_q_heads
        else:
            base = k_ptr + token * stride_kt
            stride_h = stride_kh
            heads = num_k_heads
        mask = (h[:, None] < heads) & dmask[None, :]
        p1 = base + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        o1 = rotate_half(x1, x2, cos1[None, :], sin1[None, :], -1.0)
        o2 = rotate_half(x2, x1, cos2[None, :], sin2[None, :], 1.0)
        tl.store(p1, o1, mask=mask)
        tl.store(p1 + HALF, o2, mask=mask)
    if WRITE_KV:
        # The rotated k and this token's v, into the paged cache at its slot
        # (padding tokens, slot -1, store nothing), as write_kv_cache does.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        safe = tl.maximum(slot, 0)
        mask = (h[:, None] < num_k_heads) & dmask[None, :] & ((h[:, None] * 0 + slot) >= 0)
        dst = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs
        dst = dst + h[:, None] * stride_ch + d[None, :]
        ty = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, o1.to(ty), mask=mask)
        tl.store(kc_ptr + dst + HALF, o2.to(ty), mask=mask)
        v_row = v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :]
        tl.store(vc_ptr + dst, tl.load(v_row, mask=mask).to(ty), mask=mask)
        tl.store(vc_ptr + dst + HALF, tl.load(v_row + HALF, mask=mask).to(ty), mask=mask)


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rotate-half convention, all of
    D rotated); cos/sin are fp32 [max_pos, D] tables. ``cache``: (v, kv_cache,
    slot_mapping) also stores the rotated k and v in the paged cache, as
    ``paged_attention.write_kv_cache(k, v, kv_cache, slot_mapping)`` would
    afterwards, in the same kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1
    assert cos.shape[1] == head_dim and head_dim % 2 == 0
    half = head_dim // 2
    if cache is None:
        v = kc = vc = slots = q  # unused
        v_strides, cache_strides, block_size = (0, 0), (0, 0, 0), 1
    else:
        v, kv_cache, slots = cache
        assert v.shape == k.shape and v.stride(2) == 1 and kv_cache.stride(4) == 1
        assert kv_cache.shape[3:] == k.shape[1:]
        kc, vc = kv_cache[0], kv_cache[1]
        v_strides, cache_strides = (v.stride(0), v.stride(1)), kc.stride()[:3]
        block_size = kv_cache.shape[2]
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        v, kc, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        *v_strides, *cache_strides,
        num_q_heads, k.shape[1],
        HALF=half, HALF_P2=triton.next_power_of_2(half),
        HEADS_P2=triton.next_power_of_2(max(num_q_heads, k.shape[1])),
        WRITE_KV=cache is not None, BLOCK_SIZE=block_size,
        **pdl_args(q.device),
    )
