"""LoRA wrappers for the column- and row-parallel linear layers of tensor
parallelism, each rank holding its shard of every adapter.

Column-parallel (merged QKV, merged gate/up; each rank owns some output rows):
  default        A whole on every rank, B's rows of this rank's outputs:
                 y_local += (x A^T) B_local^T, no communication.
  fully sharded  A's rank dimension split too: x A_local^T is [T, r / N], the
                 ranks all_gather it to [T, r], then expand with B_local.
Row-parallel (o, down; each rank owns some input columns, the outputs are
summed by an all_reduce):
  default        A's columns of this rank's inputs, B whole: the partial
                 (x_local A_local^T) B^T goes into the partial output before its
                 all_reduce, which sums the LoRA update too.
  fully sharded  the [T, r] partial shrink is all_reduced first, then each rank
                 expands only its share of the output rows with its rows of B
                 (the output all_reduce assembles them).

The split shrink and expand run through the punica wrapper's one fused op
(``add_lora_linear``), with identity matrices standing for the missing half,
so they use the same kernels (and stay CUDA-graph safe) on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.lora.layers import LinearWithLoRA, targets
from loraserve.lora.peft_adapter import ModelLoRAInfo
from loraserve.lora.punica import PunicaWrapper
from loraserve.lora.slot_stacks import SlotSpec
from loraserve.model.linear import ColumnParallelLinear, RowParallelLinear


def _eye_stack(num_slots: int, rows: int, cols: int, offset: int, dtype, device) -> torch.Tensor:
    """[num_slots, rows, cols]: ones on the diagonal starting at column ``offset``."""
    eye = torch.zeros(rows, cols, dtype=dtype, device=device)
    eye[:, offset:offset + rows] = torch.eye(rows, dtype=dtype, device=device)
    return eye.expand(num_slots, rows, cols).contiguous()


class _ParallelLinearWithLoRA(LinearWithLoRA):
    """Slot stacks sized for this rank's shard; ``fully_sharded`` picks the layout."""

    def __init__(
        self,
        base: nn.Linear,
        slice_sizes: list[int],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        punica: PunicaWrapper,
        fully_sharded: bool,
    ) -> None:
        super().__init__(base, slice_sizes, num_slots, max_rank, dtype, punica)
        self.fully_sharded = fully_sharded
        self.tp = base.tp
        self.max_rank = max_rank

    # The base layer class this wrapper shards alike.
    base_class: type[nn.Linear]

    @classmethod
    def can_replace_layer(cls, layer: nn.Module, path: str, model: nn.Module) -> bool:
        return isinstance(layer, cls.base_class) and targets(model, path)

    @classmethod
    def from_layer(cls, layer: nn.Linear, path: str, model: nn.Module,
                   spec: SlotSpec) -> _ParallelLinearWithLoRA:
        return cls(layer, model.slice_sizes(path.rsplit(".", 1)[-1]), spec.num_slots,
                   spec.max_rank, spec.dtype, spec.punica, spec.fully_sharded)

    def describe(self, path: str, model: nn.Module, info: ModelLoRAInfo) -> None:
        # Adapters hold the whole model's shapes; each rank keeps its shard.
        leaf = path.rsplit(".", 1)[-1]
        base = self.base_layer
        info.add_module(path, model.lora_modules[leaf],
                        getattr(base, "full_in_features", base.in_features),
                        model.full_slice_sizes(leaf))

    def _zeros(self, *shape: int) -> torch.Tensor:
        a = self.lora_a[0]
        return torch.zeros(*shape, dtype=a.dtype, device=a.device)

    def _shrink(self, x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
        """[T, slices * rank]: x @ A[slot].T of each slice, side by side."""
        rank = lora_a[0].shape[1]
        u = self._zeros(x.shape[0], len(lora_a) * rank)
        self.punica.add_lora_linear(u, x, lora_a, [self._shrink_eye] * len(lora_a))
        return u

    def _expand(self, y: torch.Tensor, u: torch.Tensor, lora_b: list[torch.Tensor]) -> None:
        """y[:, slice i] += u[:, slice i's rank columns] @ B_i[slot].T."""
        self.punica.add_lora_linear(y, u, self._expand_selectors, lora_b)


class ColumnParallelLinearWithLoRA(_ParallelLinearWithLoRA):
    base_class = ColumnParallelLinear

    def __init__(self, base: ColumnParallelLinear, slice_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, punica: PunicaWrapper,
                 fully_sharded: bool) -> None:
        super().__init__(base, slice_sizes, num_slots, max_rank, dtype, punica, fully_sharded)
        if not fully_sharded:
            return
        world = self.tp.world_size
        local_rank = max_rank // world
        self.lora_a = [self._zeros(num_slots, local_rank, base.in_features)
                       for _ in slice_sizes]
        dev, ns = self.lora_a[0].device, len(slice_sizes)
        self._shrink_eye = _eye_stack(num_slots, local_rank, local_rank, 0, dtype, dev)
        self._expand_selectors = [
            _eye_stack(num_slots, max_rank, ns * max_rank, i * max_rank, dtype, dev)
            for i in range(ns)
        ]

    def slot_share(self, index: int, a: torch.Tensor,
                   b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """B's rows of this rank's outputs; fully sharded, A's share of the (padded)
        rank dimension too."""
        b = self.base_layer.shard_rows(b, index)
        if self.fully_sharded:
            start, length = self.tp.shard(self.max_rank)
            padded = torch.zeros(self.max_rank, a.shape[1], dtype=a.dtype)
            padded[:a.shape[0]] = a
            a = padded[start:start + length]
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fully_sharded:
            return super().forward(x)
        y = self.base_layer(x)
        if self.punica.any_lora:
            ns, world = len(self.lora_a), self.tp.world_size
            local = self._shrink(x, self.lora_a)  # [T, ns * r / N]
            parts = self.tp.all_gather(local)  # [N, T, ns * r / N]
            rank_part = local.shape[1] // ns
            u = parts.view(world, x.shape[0], ns, rank_part).permute(1, 2, 0, 3)
            self._expand(y, u.reshape(x.shape[0], ns * self.max_rank), self.lora_b)
        return y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fully_sharded:
            return super().silu_and_mul(x)
        return self.base_layer.ops.silu_and_mul(self.forward(x))


class RowParallelLinearWithLoRA(_ParallelLinearWithLoRA):
    base_class = RowParallelLinear

    def __init__(self, base: RowParallelLinear, slice_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, punica: PunicaWrapper,
                 fully_sharded: bool) -> None:
        super().__init__(base, slice_sizes, num_slots, max_rank, dtype, punica, fully_sharded)
        if not fully_sharded:
            return
        (out,) = slice_sizes
        if out % self.tp.world_size:
            raise ValueError(f"output width {out} does not split over "
                             f"{self.tp.world_size} ranks")
        self.out_shard = self.tp.shard(out)
        self.lora_b = [self._zeros(num_slots, self.out_shard[1], max_rank)]
        dev = self.lora_b[0].device
        self._shrink_eye = _eye_stack(num_slots, max_rank, max_rank, 0, dtype, dev)
        self._expand_selectors = [_eye_stack(num_slots, max_rank, max_rank, 0, dtype, dev)]

    def slot_share(self, index: int, a: torch.Tensor,
                   b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A's columns of this rank's inputs; fully sharded, B's rows of this rank's
        share of the output too."""
        a = self.base_layer.shard_cols(a)
        if self.fully_sharded:
            start, length = self.out_shard
            b = b[start:start + length]
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.fully_sharded:
            # The partial update rides in the partial output's all_reduce.
            return base.reduce(self.punica.linear(base.partial, x, self.lora_a, self.lora_b))
        y = base.partial(x)
        if self.punica.any_lora:
            u = self.tp.all_reduce(self._shrink(x, self.lora_a))  # [T, r], summed
            start, length = self.out_shard
            self._expand(y[:, start:start + length], u, self.lora_b)
        return base.reduce(y)
