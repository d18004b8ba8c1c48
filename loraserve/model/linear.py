"""The decoder's linear layer: nn.Linear, with decode-sized CUDA batches on our GEMM.

A decode step multiplies every weight by a handful of tokens. There the Triton
GEMM of loraserve.kernels.dense_gemm streams the weights faster than cuBLAS
and needs no second kernel to sum its K splits (benchmarks/RESULTS.md, sixth
session). Everything else (prefill, fp32, the CPU) keeps F.linear, so fp32
results stay those of transformers. ``LORASERVE_DECODE_GEMM=cublas`` turns the
Triton path off (for side-by-side benchmarks).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_TRITON_DTYPES = (torch.bfloat16, torch.float16)


def _triton_enabled() -> bool:
    return os.environ.get("LORASERVE_DECODE_GEMM", "triton") != "cublas"


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_gemm = _triton_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self._decode_rows(x)
        if flat is not None:
            from loraserve.kernels.dense_gemm import dense_linear, use_kernel

            if use_kernel(flat.shape[0], *self.weight.shape):
                out = dense_linear(flat, self.weight, self.bias)
                return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this merged gate/up layer's output, on CUDA; decode
        batches in one kernel, without writing the [T, 2I] output."""
        from loraserve.kernels.activation import silu_and_mul
        from loraserve.kernels.dense_gemm import dense_linear, use_fused_silu_and_mul

        flat = self._decode_rows(x)
        if flat is not None and use_fused_silu_and_mul(flat.shape[0]):
            out = dense_linear(flat, self.weight, self.bias, silu_mul=True)
            return out.view(*x.shape[:-1], out.shape[-1])
        return silu_and_mul(self(x))

    def _decode_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """x as [T, K] rows when our decode GEMM may take it, else None."""
        if not (self.decode_gemm and x.is_cuda and x.dtype in _TRITON_DTYPES):
            return None
        flat = x.reshape(-1, x.shape[-1])
        return flat if flat.stride(-1) == 1 else None
