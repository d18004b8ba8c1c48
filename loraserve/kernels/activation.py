"""SiLU-and-multiply of the merged gate/up output in one kernel.

`F.silu(gate) * up` is two kernels and a [T, I] temporary in torch; this reads
gate and up once and writes the product. Rounding follows torch: silu in fp32,
rounded to the activation dtype, then the product in fp32, rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_begin

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up for gate and up in the activation dtype, rounded as torch
    rounds `F.silu(gate) * up` (every kernel that applies the activation uses this)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, width,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, _BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=_BLOCK,
            **pdl_args(out.device),
        )
    return out
