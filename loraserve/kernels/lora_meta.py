"""Per-step LoRA metadata: tokens grouped by adapter slot, plus a workspace.

The kernels work on tiles of tokens that share one slot, so every adapter's A
and B are read once per tile instead of once per token. Grouping needs a sort,
which is done here once per step (not once per layer) with plain torch ops of
static shape: no host synchronisation, so ``update`` may also run inside a
CUDA graph capture.

The object owns fixed device buffers (sized for ``max_tokens``). For CUDA
graphs keep one object alive for the captured batch size and call
``update(token_slots)`` before each replay (or capture ``update`` into the
graph too): the kernels read the same addresses every time.
"""

from __future__ import annotations

import torch


class LoRAMetadata:
    """Token-by-slot grouping and the fp32 rank workspace used by ``add_lora_linear``.

    Buffers (all on ``device``):
      sorted_ids  int32 [max_tokens]: token indices ordered by slot (stable);
                  tokens with slot -1 come last and are never touched.
      slot_start  int32 [num_slots]: first position of each slot in sorted_ids.
      slot_count  int32 [num_slots]: number of tokens of each slot.
      locks       int32 [3 * max_tokens]: split-K arrival counters (always 0 between calls).
      tile_flags  int32 [2 * max_tokens]: per token tile, slices whose shrink is done,
                  then expand programs past the wait (one launch; 0 between calls).
      workspace   fp32 flat buffer for the shrink result (split-K partials).
    """

    def __init__(
        self,
        max_tokens: int,
        num_slots: int,
        device: torch.device | str,
        workspace_numel: int = 0,
    ) -> None:
        if max_tokens < 1 or num_slots < 1:
            raise ValueError("max_tokens and num_slots must be >= 1")
        self.max_tokens = int(max_tokens)
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.num_tokens = 0
        i32 = dict(dtype=torch.int32, device=self.device)
        self.sorted_ids = torch.zeros(self.max_tokens, **i32)
        self.slot_start = torch.zeros(self.num_slots, **i32)
        self.slot_count = torch.zeros(self.num_slots, **i32)
        # searchsorted probes 0..num_slots: boundaries of every slot's run.
        self._probes = torch.arange(self.num_slots + 1, **i32)
        # Split-K arrival counters, one per (token tile, slice); the kernel resets
        # each to 0 after use, so they are zero at every call.
        self.locks = torch.zeros(3 * self.max_tokens, **i32)
        self.tile_flags = torch.zeros(2 * self.max_tokens, **i32)
        self.workspace = torch.empty(int(workspace_numel), dtype=torch.float32, device=self.device)
        self._retired: list[torch.Tensor] = []

    def update(self, token_slots: torch.Tensor) -> LoRAMetadata:
        """Refill the buffers in place from ``token_slots`` (int [T], -1 = no adapter)."""
        t = token_slots.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens > max_tokens={self.max_tokens}")
        self.num_tokens = t
        if t == 0:
            self.slot_count.zero_()
            return self
        key = token_slots.to(torch.int32)
        # -1 (and anything out of range) sorts after every real slot.
        key = torch.where((key < 0) | (key >= self.num_slots), self.num_slots, key)
        sorted_key, order = torch.sort(key, stable=True)
        self.sorted_ids[:t].copy_(order)
        bounds = torch.searchsorted(sorted_key, self._probes).to(torch.int32)
        self.slot_start.copy_(bounds[:-1])
        self.slot_count.copy_(bounds[1:] - bounds[:-1])
        return self

    def ensure_workspace(self, numel: int) -> torch.Tensor:
        """Return the workspace, growing it if needed (never during graph capture)."""
        if self.workspace.numel() < numel:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "LoRA workspace too small during CUDA graph capture: run add_lora_linear "
                    "once eagerly for every layer shape before capturing, or pass a larger "
                    "workspace_numel to build_lora_metadata"
                )
            # A graph captured earlier may still point at the old buffer: keep it alive.
            self._retired.append(self.workspace)
            self.workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self.workspace


def build_lora_metadata(
    token_slots: torch.Tensor,
    num_slots: int,
    max_tokens: int | None = None,
    workspace_numel: int = 0,
) -> LoRAMetadata:
    """Allocate a ``LoRAMetadata`` and fill it from ``token_slots``.

    ``max_tokens`` (default: len(token_slots)) sizes the buffers so the same
    object can later be ``update``-d with fewer tokens.
    """
    t = token_slots.shape[0]
    meta = LoRAMetadata(max(1, max_tokens or t), num_slots, token_slots.device, workspace_numel)
    return meta.update(token_slots)
