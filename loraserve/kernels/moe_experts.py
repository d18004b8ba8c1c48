"""A sparse MoE block's experts on the GPU: the Triton grouped GEMM over experts
(``moe_gemm``) for the gate/up and down projections, the adapters' updates on
the experts (``moe_lora``) added to each, and the routing weights applied as
the rows are summed per token. Same formulas as the torch path
(``loraserve.model.moe_ops.torch_moe_experts``).
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul
from .moe_gemm import align_rows, block_m_for, grouped_gemm
from .moe_lora import add_moe_lora, align_lora_rows


def fused_moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora=None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), with each
    token's adapter (``lora``: a ``loraserve.model.moe_ops.ExpertsLoRA``) on the
    experts' projections: [T, H]."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = gate_up_proj.shape
    experts = topk_ids.flatten()
    rows = experts.numel()
    aligned = align_rows(experts, num_experts, block_m_for(rows, num_experts))
    gate_up = torch.empty(rows, two_inter, dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up_proj, gate_up, aligned, in_div=top_k)
    lora_rows = None
    if lora is not None:
        lora_rows = align_lora_rows(lora.token_slots, experts, top_k, num_experts,
                                    lora.gate_up_a.shape[0])
        add_moe_lora(gate_up, x, lora.gate_up_a, lora.gate_up_b, lora_rows, in_div=top_k)
    act = silu_and_mul(gate_up)
    down = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(act, down_proj, down, aligned)
    if lora_rows is not None:
        add_moe_lora(down, act, lora.down_a, lora.down_b, lora_rows)
    weighted = down.view(num_tokens, top_k, hidden) * topk_weights[..., None]
    return weighted.sum(dim=1).to(x.dtype)
