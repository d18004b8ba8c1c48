"""What a forward pass over the model needs, gathered once by the model runner and
handed to whatever runs a pass: the runner's eager path, the decode CUDA graphs
and the piecewise graphs. They read these parts and nothing else of the runner,
and call nothing back in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraserve.distributed.parallel_state import TensorParallel
from loraserve.lora.punica import PunicaWrapper
from loraserve.worker.attention import AttentionMetadata, block_table_tensor
from loraserve.worker.input_batch import PreparedInputs


@dataclass
class ForwardContext:
    model: nn.Module
    kv_caches: list[torch.Tensor]
    # The backend's attention: attention(metadata, attn_workspace) per step.
    attention: Any
    attn_workspace: torch.Tensor | None
    # The LoRA op of the decoder's layers, and the lm_head's (None unless an
    # adapter may target the lm_head): each holds the step's token -> slot mapping.
    punica: PunicaWrapper
    logits_punica: PunicaWrapper | None
    # The backend's row argmax: argmax(logits, out=...).
    argmax: Callable[..., torch.Tensor]
    tp: TensorParallel
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_blocks_per_seq: int
    # The LoRA wrappers by module path (empty without LoRA).
    lora_wrappers: Mapping[str, nn.Module]

    @property
    def lora(self) -> bool:
        return bool(self.lora_wrappers)

    @property
    def pin_memory(self) -> bool:
        # See host_tensor; pinning needs a CUDA device.
        return self.device.type == "cuda"

    def lora_launch_configs(self, num_tokens: int) -> tuple:
        """What picks every compiled LoRA kernel at this token count."""
        return tuple(sorted({w.launch_configs(num_tokens) for w in self.lora_wrappers.values()}))

    def host_tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host inputs go through pinned memory: a copy from pageable memory may wait
        for the step already running on the device."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.pin_memory)

    def to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self.host_tensor(values, dtype).to(self.device, non_blocking=True)

    def attention_for(self, inputs: PreparedInputs) -> Any:
        """The step's attention, from its exact (unpadded) metadata."""
        meta = AttentionMetadata(
            slot_mapping=self.to_device(inputs.slot_mapping),
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            block_size=self.block_size,
        )
        if self.attention.device_metadata:
            meta.block_tables_t = block_table_tensor(
                inputs.block_tables, self.pin_memory).to(self.device, non_blocking=True)
            meta.query_start_loc_t = self.to_device(inputs.query_start_loc, torch.int32)
            meta.seq_lens_t = self.to_device(inputs.seq_lens, torch.int32)
            meta.max_query_len = max(
                b - a for a, b in zip(inputs.query_start_loc, inputs.query_start_loc[1:],
                                      strict=False)
            )
        return self.attention(meta, self.attn_workspace)


@dataclass
class PendingTokens:
    """Tokens the previous step sampled that this step's inputs need (async
    scheduling), still on the device: input position dst[i] takes sampled[src[i]].
    Only rank 0 samples, so the other ranks take its filled ids."""

    sampled: torch.Tensor | None
    dst: list[int]
    src: list[int]

    def fill(self, input_ids: torch.Tensor, ctx: ForwardContext) -> None:
        if not self.dst:
            return
        if ctx.tp.is_driver:
            input_ids[ctx.to_device(self.dst)] = self.sampled[ctx.to_device(self.src)]
        ctx.tp.broadcast(input_ids)
