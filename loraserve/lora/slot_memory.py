"""What a device slot costs, and --max-loras auto: as many slots as a share of the
device memory that the model's weights leave.

A slot is one entry in every LoRA layer's A and B stacks, each as wide as
max_lora_rank: its bytes follow from the model's shapes alone. They are measured
by wrapping the same model built on the meta device (no memory, no weights) with
one slot, so every wrapper class counts as it allocates.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from loraserve.config import LoRAConfig
from loraserve.distributed.parallel_state import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

# The share of the memory left after the weights that --max-loras auto gives the
# slots; the KV cache takes most of the rest.
AUTO_SLOT_SHARE = 0.1
# Enough for any batch: a step never uses more adapters than sequences.
AUTO_MAX_LORAS = 512
# Without a device memory to size against (the CPU).
AUTO_CPU_LORAS = 8


def bytes_per_slot(hf_config: Any, lora_config: LoRAConfig, dtype: torch.dtype,
                   tp: TensorParallel = SINGLE) -> int:
    """Device bytes that one slot adds to this rank's LoRA layers."""
    from loraserve.lora.punica import TorchPunicaWrapper
    from loraserve.lora.wrapping import wrap_model
    from loraserve.model.ops import TORCH_OPS
    from loraserve.model.registry import build_model

    meta = torch.device("meta")
    model = build_model(hf_config, dtype, meta, 1, TORCH_OPS, tp)
    punica = TorchPunicaWrapper(1, 1, meta)
    logits_punica = punica if "lm_head" in model.lora_modules else None
    wrappers, _ = wrap_model(model, replace(lora_config, max_loras=1), punica, logits_punica)
    return sum(t.numel() * t.element_size() for w in wrappers.values() for t in _stacks(w))


def _stacks(wrapper: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The slot stacks a wrapper holds (its tensors, not its base layer's)."""
    for value in vars(wrapper).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def resolve_max_loras(lora_config: LoRAConfig, hf_config: Any, dtype: torch.dtype,
                      device: torch.device, memory_utilization: float, max_num_seqs: int,
                      tp: TensorParallel = SINGLE) -> LoRAConfig:
    """The config with max_loras decided, for --max-loras auto (as it is otherwise):
    on a GPU, AUTO_SLOT_SHARE of what the weights leave of the memory share, at most
    AUTO_MAX_LORAS, max_num_seqs and max_cpu_loras, the same on every rank."""
    if not lora_config.auto_max_loras:
        return lora_config
    per_slot = bytes_per_slot(hf_config, lora_config, dtype, tp)
    cap = min(AUTO_MAX_LORAS, max_num_seqs, lora_config.max_cpu_loras or AUTO_MAX_LORAS)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        left = int(total * memory_utilization) - (total - free)
        slots = max(1, min(cap, int(left * AUTO_SLOT_SHARE) // per_slot))
    else:
        slots = min(cap, AUTO_CPU_LORAS)
    slots = tp.min_int(slots)
    logger.info("--max-loras auto: %d device slots of %.1f MiB each (%.2f GiB; rank %d)",
                slots, per_slot / 2**20, slots * per_slot / 2**30, lora_config.max_lora_rank)
    return replace(lora_config, max_loras=slots, auto_max_loras=False,
                   max_cpu_loras=lora_config.max_cpu_loras or slots)
