"""The punica wrapper: per-step token -> slot mapping, and the fused LoRA op.

Every LoRA layer runs its base projection through `linear` (or, for the merged
gate/up projection, `linear_silu_and_mul`). On CUDA the update runs the Triton
kernels of `loraserve.kernels`, which read a per-step grouping of tokens by slot
built once here, with the shrink on a side stream beside the base projection;
elsewhere plain torch ops, one matmul pair per active slot.
"""

from __future__ import annotations

import torch
from torch import nn


def _kernels_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import loraserve.kernels as kernels
    except ImportError:
        return False
    return hasattr(kernels, "add_lora_linear")


class PunicaWrapper:
    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        self.device = device
        # Preallocated so the CUDA path never allocates inside a captured graph.
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        # False: skip the LoRA ops entirely (no adapter in the step, or a graph
        # captured for the no-LoRA case).
        self.any_lora = False
        self._slot_rows: list[tuple[int, torch.Tensor]] = []
        self.meta = None
        if _kernels_available(device):
            from loraserve.kernels import LoRAMetadata

            self.meta = LoRAMetadata(max_num_tokens, num_slots, device)
            # The shrinks run here, beside the base projections (also in CUDA graphs,
            # as a branch of the captured graph).
            self.side_stream = torch.cuda.Stream(device)

    def update_mapping(self, token_slots: list[int]) -> None:
        """Set the slot of each token of this step (-1: no adapter)."""
        n = len(token_slots)
        if n > self.token_slots.numel():
            raise ValueError(f"{n} tokens exceed the punica buffer of {self.token_slots.numel()}")
        slots = torch.tensor(token_slots, dtype=torch.int32,
                             pin_memory=self.device.type == "cuda")
        self.any_lora = bool((slots >= 0).any())
        if self.meta is not None:
            self.token_slots[:n].copy_(slots, non_blocking=True)
            self.meta.update(self.token_slots[:n])
            return
        self._slot_rows = [
            (int(s), torch.nonzero(slots == s).flatten().to(self.device))
            for s in torch.unique(slots).tolist()
            if s >= 0
        ]

    def refresh_device_mapping(self, num_tokens: int) -> None:
        """Regroup from `token_slots` already on the device (CUDA graph replays)."""
        if self.meta is not None:
            self.meta.update(self.token_slots[:num_tokens])

    def launch_configs(self, num_tokens: int, k: int, widths: list[int], rank: int) -> tuple:
        """What picks the compiled kernels of a layer's LoRA op at this token count
        (empty without the CUDA kernels)."""
        if self.meta is None:
            return ()
        from loraserve.kernels import launch_configs

        return launch_configs(num_tokens, k, widths, rank)

    def linear(
        self,
        base: nn.Module,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        """base(x) plus the LoRA update of every token's adapter."""
        y, ws = self._project(base, x, lora_a, lora_b, allow_one_launch=True)
        if ws is None:
            self.add_lora_linear(y, x, lora_a, lora_b)
        else:
            from loraserve.kernels import lora_expand

            lora_expand(y, lora_b, self.meta, ws)
        return y

    def linear_silu_and_mul(
        self,
        base: nn.Module,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        """silu(gate) * up of a merged gate/up projection base(x) (CUDA), the LoRA
        update added first; with the kernels, inside the activation's one pass."""
        base_fused = getattr(base, "silu_and_mul", None)
        if not self.any_lora and base_fused is not None:
            # No adapter in the batch: the base layer's own fused path.
            return base_fused(x)
        # The expand goes into the activation: never the one-launch op.
        gate_up, ws = self._project(base, x, lora_a, lora_b, allow_one_launch=False)
        if ws is None:
            from loraserve.kernels.activation import silu_and_mul

            self.add_lora_linear(gate_up, x, lora_a, lora_b)
            return silu_and_mul(gate_up)
        from loraserve.kernels import silu_and_mul_lora

        return silu_and_mul_lora(gate_up, x, lora_a, lora_b, self.meta, ws=ws)

    def _project(
        self,
        base: nn.Module,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
        allow_one_launch: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """base(x), with the LoRA shrink of x run beside it on the side stream (both
        only read x) and joined before returning: (y, shrink workspace). The
        workspace is None where the shrink does not run apart: no kernels, or (if
        allowed) add_lora_linear runs shrink and expand as one launch at this size."""
        if not self.any_lora or self.meta is None:
            return base(x), None
        from loraserve.kernels import lora_shrink
        from loraserve.kernels.lora_ops import MAX_SLICES_PER_LAUNCH, prefers_one_launch

        num_tokens, k = x.shape
        widths = [b.shape[1] for b in lora_b]
        if len(lora_a) > MAX_SLICES_PER_LAUNCH or (
            allow_one_launch and prefers_one_launch(num_tokens, k, widths, lora_a[0].shape[1])
        ):
            return base(x), None
        main = torch.cuda.current_stream()
        # Also orders this shrink after the previous layer's expand, which read
        # the same workspace.
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):
            ws = lora_shrink(x, lora_a, self.meta)
        y = base(x)
        main.wait_stream(self.side_stream)
        return y, ws

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> None:
        """y[t, slice i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T for s = slot of t."""
        if not self.any_lora:
            return
        if self.meta is not None:
            from loraserve.kernels import add_lora_linear

            add_lora_linear(y, x, lora_a, lora_b, self.token_slots[: x.shape[0]], self.meta)
            return
        for slot, rows in self._slot_rows:
            xs = x[rows].to(lora_a[0].dtype)
            offset = 0
            for a, b in zip(lora_a, lora_b, strict=True):
                width = b.shape[1]
                delta = (xs @ a[slot].T) @ b[slot].T
                y[rows, offset:offset + width] += delta.to(y.dtype)
                offset += width
