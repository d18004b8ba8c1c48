"""MoE LoRA: each row's adapter update on the expert it was routed to, in one
shrink and one expand launch over all (slot, expert) groups.

For row p (token p // in_div) of expert e whose token has slot s >= 0:

    y[p] += (x[p // in_div] @ A[s, e].T) @ B[s, e].T

with A [S, E, R, K] and B [S, E, N, R] (scaling folded into B, ranks zero-padded
to R). Rows are grouped by g = s * E + e (``moe_gemm.align_rows``), so every
block of rows shares one A and one B, and both halves are grouped GEMMs over
A and B seen as [S * E, R, K] and [S * E, N, R]. The shrink keeps its [P, R]
result in the LoRA dtype, as the torch reference (``loraserve.model.moe_ops``)
rounds it.
"""

from __future__ import annotations

import torch

from .moe_gemm import AlignedRows, align_rows, grouped_gemm

# Rows per block of a (slot, expert) group, whatever the batch: a group holds
# few rows, and one compiled variant serves every batch size, so the CUDA graphs
# of smaller decode batches find it compiled by the largest one's warm-up.
LORA_BLOCK_M = 16


def align_lora_rows(
    token_slots: torch.Tensor, expert_of_row: torch.Tensor, top_k: int, num_experts: int,
    num_slots: int,
) -> AlignedRows:
    """The rows of a MoE step grouped by (slot of their token, expert); rows whose
    token has no adapter belong to no group."""
    slots = token_slots.to(torch.int64).repeat_interleave(top_k)
    group = torch.where(slots >= 0, slots * num_experts + expert_of_row.to(torch.int64), -1)
    num_groups = num_slots * num_experts
    return align_rows(group, num_groups, LORA_BLOCK_M)


def add_moe_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    aligned: AlignedRows,
    in_div: int = 1,
) -> None:
    """y[p] += (x[p // in_div] @ lora_a[s, e].T) @ lora_b[s, e].T for the rows of
    ``aligned`` (from align_lora_rows), in place."""
    slots, experts, rank, k = lora_a.shape
    n = lora_b.shape[2]
    shrunk = torch.empty(y.shape[0], rank, dtype=lora_a.dtype, device=y.device)
    grouped_gemm(x, lora_a.view(slots * experts, rank, k), shrunk, aligned, in_div=in_div)
    grouped_gemm(shrunk, lora_b.view(slots * experts, n, rank), y, aligned, accumulate=True)
