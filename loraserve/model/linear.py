"""The decoder's linear layer: nn.Linear, computed by the ops it was built with
(``loraserve.model.ops``: plain torch, or the Triton decode GEMM on a GPU)."""

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
