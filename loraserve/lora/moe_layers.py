"""The LoRA wrapper of a MoE block's experts (``loraserve.model.moe.Experts``).

Per device slot and expert it holds A and B for the fused gate/up projection
(A [R, H], B [2I, R]: one A for both halves, as PEFT's ``target_parameters``
LoRA on ``experts.gate_up_proj`` has it) and for the down projection (A [R, I],
B [H, R]), zero-padded to max_lora_rank. The router takes no LoRA. Each step
the experts op gets every token's slot from the shared punica wrapper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from loraserve.lora.moe_adapter import ExpertsInfo, ExpertsModuleLoRA
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.slot_stacks import SlotSpec, write_slot
from loraserve.model.moe import Experts
from loraserve.model.moe_ops import ExpertsLoRA

if TYPE_CHECKING:
    from loraserve.lora.peft_adapter import ModelLoRAInfo


class ExpertsWithLoRA(nn.Module):
    def __init__(
        self,
        base: Experts,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        punica: PunicaWrapper,
    ) -> None:
        super().__init__()
        self.base_layer = base
        num_experts, hidden, inter = base.num_experts, base.hidden_size, base.intermediate_size
        device = base.gate_up_proj.device

        def stack(*shape: int) -> torch.Tensor:
            return torch.zeros(num_slots, num_experts, *shape, dtype=dtype, device=device)

        # Index 0: gate_up, 1: down (the order of ExpertsModuleLoRA's lists).
        self.lora_a = [stack(max_rank, hidden), stack(max_rank, inter)]
        self.lora_b = [stack(2 * inter, max_rank), stack(hidden, max_rank)]
        self.punica = punica

    @classmethod
    def can_replace_layer(cls, layer: nn.Module, path: str, model: nn.Module) -> bool:
        # The experts take LoRA on their projections whatever the layer is called;
        # the router takes none.
        return isinstance(layer, Experts)

    @classmethod
    def from_layer(cls, layer: Experts, path: str, model: nn.Module,
                   spec: SlotSpec) -> ExpertsWithLoRA:
        return cls(layer, spec.num_slots, spec.max_rank, spec.dtype, spec.punica)

    def describe(self, path: str, model: nn.Module, info: ModelLoRAInfo) -> None:
        base = self.base_layer
        info.experts[path] = ExpertsInfo(base.num_experts, base.hidden_size,
                                         base.intermediate_size, model.expert_projections)
        info.projection_names.update(model.expert_projections)

    def set_slot(self, slot: int, weights: ExpertsModuleLoRA | None) -> None:
        """Copy one adapter's expert weights into a slot; None zeroes it."""
        if weights is None:
            pairs = [None] * len(self.lora_a)
        else:
            pairs = [None if a is None else (a, b)
                     for a, b in zip(weights.lora_a, weights.lora_b, strict=True)]
        write_slot(self.lora_a, self.lora_b, slot, pairs)

    def launch_configs(self, num_tokens: int) -> tuple:
        """Nothing here picks compiled kernels by batch (see LinearWithLoRA)."""
        return ()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        lora = None
        if self.punica.any_lora:
            lora = ExpertsLoRA(self.punica.token_slots[: x.shape[0]], self.lora_a[0],
                               self.lora_b[0], self.lora_a[1], self.lora_b[1])
        return self.base_layer(x, topk_weights, topk_ids, lora)
