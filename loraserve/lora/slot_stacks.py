"""Copying an adapter into the per-slot weight stacks of a LoRA wrapper."""

from __future__ import annotations

import torch


def write_slot(a_stacks: list[torch.Tensor], b_stacks: list[torch.Tensor], slot: int,
               pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Zero slot `slot` of each (A, B) stack pair, then copy in the adapter's (a, b)
    where it has one. A stacks are [slot, ..., rank, in] and B stacks [slot, ..., out,
    rank] (the dots: an expert dimension); a smaller rank stays zero-padded."""
    for a_stack, b_stack, pair in zip(a_stacks, b_stacks, pairs, strict=True):
        a_stack[slot].zero_()
        b_stack[slot].zero_()
        if pair is None:
            continue
        a, b = pair
        a_stack[slot][..., :a.shape[-2], :].copy_(a, non_blocking=True)
        b_stack[slot][..., :b.shape[-1]].copy_(b, non_blocking=True)
