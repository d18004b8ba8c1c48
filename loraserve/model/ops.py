"""The decoder's norm, linear layer and activation (and greedy sampling's argmax
over its logits), in plain torch.

The model's layers call these through the ``ops`` object they are built with,
which the model runner picks once for its device: ``TorchOps`` here (the CPU,
and the reference), or ``loraserve.model.triton_ops.TritonOps`` on a GPU, which
runs the same formulas in Triton kernels. The order of operations is
transformers', so fp32 results match it bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.model.moe_ops import ExpertsLoRA, torch_moe_experts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension: normalised in fp32, rounded back to x's dtype,
    then scaled by ``weight``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate then up) -> silu(gate) * up, [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchOps:
    """Plain torch: any device, any dtype."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``: (norm(residual + x), residual + x)."""
        if residual is None:
            return rms_norm(x, weight, eps)
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias)."""
        return F.linear(x, weight, bias)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a merged gate/up output [..., 2I]."""
        return silu_and_mul(gate_up)

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """silu(gate) * up of the merged gate/up projection x @ weight.T (+ bias)."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        lora: ExpertsLoRA | None = None,
    ) -> torch.Tensor:
        """A sparse MoE block's experts, weighted and summed per token (moe_ops)."""
        return torch_moe_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids, lora)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """logits.argmax(-1) of [B, V] logits (the first of equal maxima), into ``out``
        if given."""
        return torch.argmax(logits, dim=-1, out=out)


# Stateless: every layer built without an ``ops`` argument shares it.
TORCH_OPS = TorchOps()
