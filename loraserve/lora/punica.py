"""The punica wrapper: per-step token -> slot mapping, and the fused LoRA op.

Every LoRA layer runs its base projection through ``linear`` (or, for the merged
gate/up projection, ``linear_silu_and_mul``), which adds the update of each
token's adapter. The model runner picks one implementation for its device:
``TorchPunicaWrapper`` here (plain torch, one matmul pair per active slot), or
``loraserve.lora.punica_triton.TritonPunicaWrapper`` on a GPU (the Triton
kernels of ``loraserve.kernels``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from loraserve.model.ops import silu_and_mul

# A base projection: a layer, or any function of x.
Projection = Callable[[torch.Tensor], torch.Tensor]


class PunicaWrapper(ABC):
    """What the LoRA layers call; one object shared by every layer of a model."""

    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        self.max_num_tokens = max_num_tokens
        self.num_slots = num_slots
        self.device = device
        # False: skip the LoRA ops entirely (no adapter in the step, or a graph
        # captured for the no-LoRA case).
        self.any_lora = False

    def _check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed the punica buffer of {self.max_num_tokens}"
            )

    @abstractmethod
    def update_mapping(self, token_slots: list[int]) -> None:
        """Set the slot of each token of this step (-1: no adapter)."""

    def clear_mapping(self) -> None:
        """No token of this step has an adapter: the LoRA ops are skipped."""
        self.any_lora = False

    def refresh_device_mapping(self, num_tokens: int) -> None:
        """Regroup from ``token_slots`` already on the device (CUDA graph replays)."""
        raise NotImplementedError(f"{type(self).__name__} replays no CUDA graphs")

    def use_device_mapping(self, num_tokens: int, with_lora: bool,
                           like: PunicaWrapper | None = None) -> None:
        """For a captured graph: run the LoRA ops (with_lora) on the slots a replay
        finds in ``token_slots`` (copied there from `like`'s), regrouped on the
        device; or skip them."""
        self.any_lora = with_lora
        if with_lora:
            if like is not None:
                self.token_slots[:num_tokens].copy_(like.token_slots[:num_tokens])
            self.refresh_device_mapping(num_tokens)

    def launch_configs(self, num_tokens: int, k: int, widths: list[int], rank: int) -> tuple:
        """What picks the compiled kernels of a layer's LoRA op at this token count
        (empty where nothing is compiled)."""
        return ()

    @abstractmethod
    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> None:
        """y[t, slice i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T for s = slot of t."""

    @abstractmethod
    def add_lora_embedding(
        self,
        y: torch.Tensor,
        input_ids: torch.Tensor,
        lora_a_t: torch.Tensor,
        lora_b: torch.Tensor,
    ) -> None:
        """y[t] += lora_a_t[s, input_ids[t]] @ lora_b[s].T for s = slot of t."""

    @abstractmethod
    def linear(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        """base(x) plus the LoRA update of every token's adapter."""

    @abstractmethod
    def linear_silu_and_mul(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        """silu(gate) * up of a merged gate/up projection base(x), the LoRA update
        added first."""


class TorchPunicaWrapper(PunicaWrapper):
    """Plain torch ops: for each slot in the step, its tokens' rows through A then B."""

    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        super().__init__(max_num_tokens, num_slots, device)
        self._slot_rows: list[tuple[int, torch.Tensor]] = []
        # Each token's slot, for the MoE experts' LoRA (loraserve.lora.moe_layers).
        self.token_slots = torch.empty(0, dtype=torch.int32, device=device)

    def update_mapping(self, token_slots: list[int]) -> None:
        self._check_num_tokens(len(token_slots))
        slots = torch.tensor(token_slots, dtype=torch.int32)
        self.any_lora = bool((slots >= 0).any())
        self.token_slots = slots.to(self.device)
        self._slot_rows = [
            (int(s), torch.nonzero(slots == s).flatten().to(self.device))
            for s in torch.unique(slots).tolist()
            if s >= 0
        ]

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> None:
        if not self.any_lora:
            return
        for slot, rows in self._slot_rows:
            xs = x[rows].to(lora_a[0].dtype)
            offset = 0
            for a, b in zip(lora_a, lora_b, strict=True):
                width = b.shape[1]
                delta = (xs @ a[slot].T) @ b[slot].T
                y[rows, offset:offset + width] += delta.to(y.dtype)
                offset += width

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        input_ids: torch.Tensor,
        lora_a_t: torch.Tensor,
        lora_b: torch.Tensor,
    ) -> None:
        if not self.any_lora:
            return
        for slot, rows in self._slot_rows:
            delta = lora_a_t[slot][input_ids[rows]] @ lora_b[slot].T
            y[rows] += delta.to(y.dtype)

    def linear(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        y = base(x)
        self.add_lora_linear(y, x, lora_a, lora_b)
        return y

    def linear_silu_and_mul(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        base_fused = getattr(base, "silu_and_mul", None)
        if not self.any_lora and base_fused is not None:
            return base_fused(x)
        return silu_and_mul(self.linear(base, x, lora_a, lora_b))
