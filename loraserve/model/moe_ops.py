"""The experts of a sparse MoE block in plain torch, with per-token LoRA on the
experts' projections: the CPU path, and the reference for the Triton kernels
(``loraserve.kernels.moe_gemm``, ``.moe_lora``).

For token t routed to expert e with weight w, and its adapter's slot s:

    gate_up = x[t] @ W13[e].T + (x[t] @ A13[s, e].T) @ B13[s, e].T
    h       = silu(gate_up[:I]) * gate_up[I:]
    y       = h @ W2[e].T + (h @ A2[s, e].T) @ B2[s, e].T
    out[t] += w * y

(no LoRA term where s = -1). The order of operations is transformers', so fp32
results without LoRA match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertsLoRA:
    """One step's LoRA for an experts layer: each token's slot (-1: none), and per
    projection the slot stacks A [S, E, R, K] and B [S, E, N, R] (scaling folded
    into B, ranks zero-padded to R)."""

    token_slots: torch.Tensor
    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


def torch_moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: ExpertsLoRA | None = None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]): [T, H]."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        tokens, which = torch.where(topk_ids == expert)
        h = x[tokens]
        gate_up = F.linear(h, gate_up_proj[expert])
        if lora is not None:
            slots = lora.token_slots[tokens]
            add_expert_lora(gate_up, h, slots, lora.gate_up_a, lora.gate_up_b, expert)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        y = F.linear(act, down_proj[expert])
        if lora is not None:
            add_expert_lora(y, act, slots, lora.down_a, lora.down_b, expert)
        y = y * topk_weights[tokens, which, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def add_expert_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    expert: int,
) -> None:
    """y[i] += (x[i] @ lora_a[s, expert].T) @ lora_b[s, expert].T for s = slots[i] >= 0."""
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).flatten()
        xs = x[rows].to(lora_a.dtype)
        delta = (xs @ lora_a[slot, expert].T) @ lora_b[slot, expert].T
        y[rows] += delta.to(y.dtype)
