"""The decoder's norm, linear layer, activation and greedy argmax on CUDA, in
Triton kernels.

In eager torch a norm or an activation is several small kernels, and inside a
decode CUDA graph every one is a node with its own launch gap; here each is one
kernel (``loraserve.kernels.fused_norm_rope``, ``.activation``). Decode-sized
batches (up to ``dense_gemm.MAX_TOKENS`` tokens) in 16-bit types run their
linear layers on the Triton GEMM of ``loraserve.kernels.dense_gemm``, which
streams the weights faster than cuBLAS and sums its K splits in the same launch,
on the GPUs whose tuned table says so (benchmarks/RESULTS.md); the merged
gate/up projection then applies SiLU-and-multiply in that GEMM's epilogue.
Everything else (prefill, fp32) stays on F.linear, so fp32 results stay
transformers'.

Imported only where the model runner picks the Triton backend (it needs triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.kernels.activation import silu_and_mul
from loraserve.kernels.argmax import argmax_rows
from loraserve.kernels.dense_gemm import dense_linear, use_fused_silu_and_mul, use_kernel
from loraserve.kernels.fused_norm_rope import rms_norm
from loraserve.kernels.moe_experts import fused_moe_experts
from loraserve.model.moe_ops import ExpertsLoRA
from loraserve.model.ops import TorchOps

_GEMM_DTYPES = (torch.bfloat16, torch.float16)


class TritonOps(TorchOps):
    """For tensors on a CUDA device."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # One kernel for the residual add and the norm.
        flat = x.reshape(-1, x.shape[-1])
        if residual is None:
            return rms_norm(flat, weight, eps).view(x.shape)
        return rms_norm(flat, weight, eps, residual=residual).view(x.shape), residual

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        flat = _decode_rows(x)
        if flat is not None and use_kernel(flat.shape[0], *weight.shape):
            out = dense_linear(flat, weight, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, weight, bias)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # Decode batches in one kernel, without writing the [T, 2I] projection.
        flat = _decode_rows(x)
        if flat is not None and use_fused_silu_and_mul(flat.shape[0]):
            out = dense_linear(flat, weight, bias, silu_mul=True)
            return out.view(*x.shape[:-1], out.shape[-1])
        return silu_and_mul(self.linear(x, weight, bias))

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        lora: ExpertsLoRA | None = None,
    ) -> torch.Tensor:
        # One grouped GEMM launch over all experts per projection, and the MoE
        # LoRA over all (slot, expert) groups (loraserve/kernels/moe_experts.py).
        return fused_moe_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids, lora)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # One launch, not torch's reduce kernels (loraserve/kernels/argmax.py).
        return argmax_rows(logits if logits.stride(1) == 1 else logits.contiguous(), out)


def _decode_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [T, K] rows when the decode GEMM may take it, else None."""
    if x.dtype not in _GEMM_DTYPES:
        return None
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else None
