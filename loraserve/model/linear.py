"""The decoder's linear layers: nn.Linear, computed by the ops it was built with
(``loraserve.model.ops``: plain torch, or the Triton decode GEMM on a GPU), and
its column- and row-parallel shards for tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn

from loraserve.model.ops import TORCH_OPS, TorchOps


class Linear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        ops: TorchOps = TORCH_OPS,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this merged gate/up layer's output; with the Triton
        ops, decode batches in one kernel without writing the [T, 2I] output."""
        return self.ops.linear_silu_and_mul(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """A (merged) projection whose output rows are split over the tensor-parallel
    ranks: each rank holds, per slice, the rows ``shards[i] = (start, length)`` of
    the full slice, and its output stays local (heads or MLP columns of its own).
    """

    def __init__(
        self,
        in_features: int,
        shards: list[tuple[int, int]],
        bias: bool,
        tp,
        ops: TorchOps = TORCH_OPS,
    ) -> None:
        super().__init__(in_features, sum(n for _, n in shards), bias=bias, ops=ops)
        self.shards = list(shards)
        self.tp = tp

    def shard_rows(self, full: torch.Tensor, slice_idx: int) -> torch.Tensor:
        """This rank's rows of one full slice (a weight, a bias or a LoRA B)."""
        start, length = self.shards[slice_idx]
        return full[start:start + length]


class RowParallelLinear(Linear):
    """A projection whose input columns are split over the ranks: each computes a
    partial product of its columns, and the sum over ranks (all_reduce) is the
    output, the bias added once after it."""

    def __init__(
        self,
        in_shard: tuple[int, int],
        out_features: int,
        bias: bool,
        tp,
        ops: TorchOps = TORCH_OPS,
    ) -> None:
        super().__init__(in_shard[1], out_features, bias=bias, ops=ops)
        self.in_shard = in_shard
        self.full_in_features = in_shard[1] * tp.world_size
        self.tp = tp

    def shard_cols(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of a full [out, in] weight (or LoRA A)."""
        start, length = self.in_shard
        return full[:, start:start + length]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, None)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from this rank's partial product (which LoRA may add to)."""
        y = self.tp.all_reduce(partial)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))
