"""The per-slot weight stacks of the LoRA wrappers: what they are sized by, and
copying an adapter into one slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraserve.lora.punica import PunicaWrapper


@dataclass(frozen=True)
class SlotSpec:
    """What every wrapper of one model shares: slot count and width, the adapters'
    dtype, the punica wrappers that map the step's tokens (and the lm_head's rows,
    ``logits_punica``) to slots, and the tensor-parallel layout."""

    num_slots: int
    max_rank: int
    dtype: torch.dtype
    punica: PunicaWrapper
    logits_punica: PunicaWrapper | None = None
    fully_sharded: bool = False


def write_slot(a_stacks: list[torch.Tensor], b_stacks: list[torch.Tensor], slot: int,
               pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Write slot `slot` of each (A, B) stack pair: the adapter's (a, b) where it has
    one, zeros elsewhere. A stacks are [slot, ..., rank, in] and B stacks [slot, ...,
    out, rank] (the dots: an expert dimension); a smaller rank is zero-padded. Only
    the padding is zeroed, not what the copy overwrites: a slot write runs on the
    step's stream, and each launch of it delays the step."""
    for a_stack, b_stack, pair in zip(a_stacks, b_stacks, pairs, strict=True):
        if pair is None:
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            continue
        a, b = pair
        # The two ranks differ where a shard splits the rank (fully sharded LoRA).
        a_rank, b_rank = a.shape[-2], b.shape[-1]
        a_stack[slot][..., :a_rank, :].copy_(a, non_blocking=True)
        b_stack[slot][..., :b_rank].copy_(b, non_blocking=True)
        if a_rank < a_stack.shape[-2]:
            a_stack[slot][..., a_rank:, :].zero_()
        if b_rank < b_stack.shape[-1]:
            b_stack[slot][..., b_rank:].zero_()
