"""The punica wrapper on CUDA: the Triton LoRA kernels of ``loraserve.kernels``.

The kernels read a per-step grouping of tokens by slot (``LoRAMetadata``),
built once a step here and shared by every layer. Where a layer's shrink and
expand run as two launches, the shrink (which, like the base projection, only
reads x) runs on a side stream beside the base projection; with CUDA graphs
that is a branch of the captured graph.

Imported only where the model runner picks the Triton backend (it needs triton).
"""

from __future__ import annotations

import torch

from loraserve.kernels.activation import silu_and_mul
from loraserve.kernels.lora_activation import silu_and_mul_lora
from loraserve.kernels.lora_common import MAX_SLICES_PER_LAUNCH
from loraserve.kernels.lora_expand import lora_expand
from loraserve.kernels.lora_meta import LoRAMetadata
from loraserve.kernels.lora_ops import add_lora_linear, launch_configs, prefers_one_launch
from loraserve.kernels.lora_shrink import lora_shrink
from loraserve.lora.punica import Projection, PunicaWrapper


def add_lora_embedding(
    y: torch.Tensor,
    input_ids: torch.Tensor,
    lora_a_t: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    identity: torch.Tensor,
    meta: LoRAMetadata,
) -> None:
    """y[t] += lora_a_t[s, input_ids[t]] @ lora_b[s].T for s = token_slots[t] >= 0.

    The gather of each token's A row is plain indexing on the device (no host
    sync, fixed shapes, so CUDA graphs capture it); the product with B is the
    LoRA kernels' op with an identity A, which skips tokens of slot -1 (whose
    gathered row, from slot 0, is never read)."""
    rows = lora_a_t[token_slots.clamp(min=0).long(), input_ids]
    add_lora_linear(y, rows, [identity], [lora_b], token_slots, meta)


class TritonPunicaWrapper(PunicaWrapper):
    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        super().__init__(max_num_tokens, num_slots, device)
        # Preallocated so that nothing is allocated inside a captured graph; a
        # decode graph's replay writes its slots here (loraserve.worker.cuda_graphs).
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.meta = LoRAMetadata(max_num_tokens, num_slots, device)
        self.side_stream = torch.cuda.Stream(device)
        # [slot, r, r] identities: the embedding's update runs as a LoRA linear op
        # on its gathered A rows (built on the first call, before any capture).
        self._eye: torch.Tensor | None = None

    def update_mapping(self, token_slots: list[int]) -> None:
        n = len(token_slots)
        self._check_num_tokens(n)
        slots = torch.tensor(token_slots, dtype=torch.int32, pin_memory=True)
        self.any_lora = bool((slots >= 0).any())
        self.token_slots[:n].copy_(slots, non_blocking=True)
        self.meta.update(self.token_slots[:n])

    def refresh_device_mapping(self, num_tokens: int) -> None:
        self.meta.update(self.token_slots[:num_tokens])

    def launch_configs(self, num_tokens: int, k: int, widths: list[int], rank: int) -> tuple:
        return launch_configs(num_tokens, k, widths, rank)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> None:
        if self.any_lora:
            add_lora_linear(y, x, lora_a, lora_b, self.token_slots[: x.shape[0]], self.meta)

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        input_ids: torch.Tensor,
        lora_a_t: torch.Tensor,
        lora_b: torch.Tensor,
    ) -> None:
        if self.any_lora:
            slots = self.token_slots[: input_ids.shape[0]]
            add_lora_embedding(y, input_ids, lora_a_t, lora_b, slots, self._identity(lora_a_t),
                               self.meta)

    def _identity(self, lora_a_t: torch.Tensor) -> torch.Tensor:
        num_slots, _, rank = lora_a_t.shape
        eye = self._eye
        if eye is None or eye.shape != (num_slots, rank, rank) or eye.dtype != lora_a_t.dtype:
            eye = self._eye = torch.eye(rank, dtype=lora_a_t.dtype, device=self.device).expand(
                num_slots, rank, rank).contiguous()
        return eye

    def linear(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        y, ws = self._project(base, x, lora_a, lora_b, allow_one_launch=True)
        if ws is None:
            self.add_lora_linear(y, x, lora_a, lora_b)
        else:
            lora_expand(y, lora_b, self.meta, ws)
        return y

    def linear_silu_and_mul(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        # With the kernels the update goes inside the activation's one pass.
        base_fused = getattr(base, "silu_and_mul", None)
        if not self.any_lora and base_fused is not None:
            # No adapter in the batch: the base layer's own fused path.
            return base_fused(x)
        # The expand goes into the activation: never the one-launch op.
        gate_up, ws = self._project(base, x, lora_a, lora_b, allow_one_launch=False)
        if ws is None:
            self.add_lora_linear(gate_up, x, lora_a, lora_b)
            return silu_and_mul(gate_up)
        return silu_and_mul_lora(gate_up, x, lora_a, lora_b, self.meta, ws=ws)

    def _project(
        self,
        base: Projection,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
        allow_one_launch: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """base(x), with the LoRA shrink of x run beside it on the side stream (both
        only read x) and joined before returning: (y, shrink workspace). The
        workspace is None where the shrink does not run apart: no adapter in the
        step, too many slices, or (if allowed) add_lora_linear runs shrink and
        expand as one launch at this size."""
        if not self.any_lora:
            return base(x), None
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
