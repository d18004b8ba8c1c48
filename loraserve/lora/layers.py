"""LoRA wrappers for the decoder's linear layers (merged QKV, o, merged gate/up,
down, the lm_head) and for the token embedding.

Each wrapper keeps the base layer and, per output slice, a stack of A and B
matrices with one entry per device slot, sized for max_lora_rank. A slot holds
one adapter; a rank below the slot width is zero-padded.

Every wrapper class says which layers it can replace (``can_replace_layer``),
builds itself from one (``from_layer``) and records what adapters may target in
it (``describe``); loraserve.lora.wrapping walks the model with them.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.lora.peft_adapter import ModelLoRAInfo, ModuleLoRA
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.slot_stacks import SlotSpec, write_slot
from loraserve.model.linear import ColumnParallelLinear, RowParallelLinear


def targets(model: nn.Module, path: str) -> bool:
    """Whether the layer at `path` is one of the model's LoRA projections."""
    return path.rsplit(".", 1)[-1] in model.lora_modules


class LinearWithLoRA(nn.Module):
    def __init__(
        self,
        base: nn.Linear,
        slice_sizes: list[int],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        punica: PunicaWrapper,
    ) -> None:
        super().__init__()
        if sum(slice_sizes) != base.out_features:
            raise ValueError(f"slices {slice_sizes} do not add up to {base.out_features}")
        self.base_layer = base
        self.slice_sizes = list(slice_sizes)
        device = base.weight.device
        self.lora_a = [
            torch.zeros(num_slots, max_rank, base.in_features, dtype=dtype, device=device)
            for _ in slice_sizes
        ]
        self.lora_b = [
            torch.zeros(num_slots, n, max_rank, dtype=dtype, device=device) for n in slice_sizes
        ]
        # A shared object, not a global: the model runner updates its mapping each step.
        self.punica = punica

    @classmethod
    def can_replace_layer(cls, layer: nn.Module, path: str, model: nn.Module) -> bool:
        return (isinstance(layer, nn.Linear) and targets(model, path)
                and not isinstance(layer, ColumnParallelLinear | RowParallelLinear))

    @classmethod
    def from_layer(cls, layer: nn.Linear, path: str, model: nn.Module,
                   spec: SlotSpec) -> LinearWithLoRA:
        # The lm_head's LoRA maps the rows whose logits are computed, not the tokens.
        punica = spec.logits_punica if path == "lm_head" and spec.logits_punica else spec.punica
        return cls(layer, model.slice_sizes(path.rsplit(".", 1)[-1]), spec.num_slots,
                   spec.max_rank, spec.dtype, punica)

    def describe(self, path: str, model: nn.Module, info: ModelLoRAInfo) -> None:
        """Record the shapes adapters hold for this layer (the whole model's)."""
        leaf = path.rsplit(".", 1)[-1]
        info.add_module(path, model.lora_modules[leaf], self.base_layer.in_features,
                        self.slice_sizes)
        if path == "lm_head":
            info.base_weights[path] = self.base_layer.weight

    def set_slot(self, slot: int, weights: ModuleLoRA | None) -> None:
        """Copy one adapter's weights into a slot; None (module not targeted) zeroes it."""
        pairs = [None if weights is None or weights.lora_a[i] is None
                 else self.slot_share(i, weights.lora_a[i], weights.lora_b[i])
                 for i in range(len(self.lora_a))]
        write_slot(self.lora_a, self.lora_b, slot, pairs)

    def slot_share(self, index: int, a: torch.Tensor,
                   b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of slice `index`'s (A, B) that this layer holds: all of it here;
        a shard under tensor parallelism (loraserve.lora.parallel_layers)."""
        return a, b

    def launch_configs(self, num_tokens: int) -> tuple:
        """Hashable: batches with equal values run the same compiled LoRA kernels."""
        return self.punica.launch_configs(
            num_tokens, self.base_layer.in_features, self.slice_sizes, self.lora_a[0].shape[1]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.punica.linear(self.base_layer, x, self.lora_a, self.lora_b)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this (merged gate/up) layer's output, the LoRA update
        added first. With the Triton kernels the update goes into the activation,
        so the [T, 2I] output is not read and written a second time to add it."""
        return self.punica.linear_silu_and_mul(self.base_layer, x, self.lora_a, self.lora_b)


class EmbeddingWithLoRA(nn.Module):
    """The token embedding plus, per token, ``A.T[id] @ B.T`` of its adapter (PEFT's
    lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r]).

    A is kept transposed, [slot, vocab, rank], so a token's row is one gather.
    """

    def __init__(
        self,
        base: nn.Embedding,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        punica: PunicaWrapper,
    ) -> None:
        super().__init__()
        self.base_layer = base
        vocab, hidden = base.weight.shape
        device = base.weight.device
        self.lora_a_t = torch.zeros(num_slots, vocab, max_rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, hidden, max_rank, dtype=dtype, device=device)
        self.punica = punica

    @classmethod
    def can_replace_layer(cls, layer: nn.Module, path: str, model: nn.Module) -> bool:
        return isinstance(layer, nn.Embedding) and targets(model, path)

    @classmethod
    def from_layer(cls, layer: nn.Embedding, path: str, model: nn.Module,
                   spec: SlotSpec) -> EmbeddingWithLoRA:
        return cls(layer, spec.num_slots, spec.max_rank, spec.dtype, spec.punica)

    def describe(self, path: str, model: nn.Module, info: ModelLoRAInfo) -> None:
        leaf = path.rsplit(".", 1)[-1]
        info.add_module(path, model.lora_modules[leaf], self.base_layer.num_embeddings,
                        model.slice_sizes(leaf))
        info.embeddings.add(path)
        info.base_weights[path] = self.base_layer.weight

    def set_slot(self, slot: int, weights: ModuleLoRA | None) -> None:
        self.lora_a_t[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is None or weights.lora_a[0] is None:
            return
        a, b = weights.lora_a[0], weights.lora_b[0]
        rank = a.shape[0]
        self.lora_a_t[slot, :, :rank].copy_(a.T, non_blocking=True)
        self.lora_b[slot, :, :rank].copy_(b, non_blocking=True)

    def launch_configs(self, num_tokens: int) -> tuple:
        rank = self.lora_b.shape[2]
        return self.punica.launch_configs(num_tokens, rank, [self.lora_b.shape[1]], rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(input_ids)
        self.punica.add_lora_embedding(y, input_ids, self.lora_a_t, self.lora_b)
        return y
